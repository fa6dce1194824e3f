"""The size rules of the house: no function in appliance/ over 60 lines, no module over 400,
no constructor with more than 8 parameters. Plain records (dataclasses and models that only
carry fields) are not constructors in this sense: their width is the width of the wire or
ledger row they mirror."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "appliance"
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400
MAX_INIT_PARAMETERS = 8


def breaches(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            found.append(f"{name}: {len(text.splitlines())} lines > {MAX_MODULE_LINES}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{name}: {node.name} is {lines} lines")
                if node.name == "__init__":
                    n = len(node.args.args) - 1 + len(node.args.kwonlyargs)
                    if n > MAX_INIT_PARAMETERS:
                        found.append(f"{name}:{node.lineno} __init__ takes {n} parameters")
    return found


def test_the_appliance_keeps_its_size_rules() -> None:
    assert breaches(PACKAGE) == []


def test_the_size_check_can_fail(tmp_path: Path) -> None:
    long_body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "wide.py").write_text(
        "class C:\n    def __init__(self, a, b, c, d, e, f, g, h, i):\n        pass\n\n"
        f"def f():\n{long_body}\n"
    )
    (tmp_path / "long.py").write_text("\n" * (MAX_MODULE_LINES + 1))
    found = breaches(tmp_path)
    assert len(found) == 3, found
    assert any("takes 9 parameters" in f for f in found)
    assert any("f is 61 lines" in f for f in found)
    assert any("long.py: 401 lines" in f for f in found)
