"""The size rules of the house, in appliance/, cli/ and tui/: no function over 60 lines, no
module over 400, no constructor with more than 8 parameters, no folder with more than 15
modules (its __init__.py not counted). Plain records (dataclasses and models that only carry
fields) are not constructors in this sense: their width is the width of the wire or ledger row
they mirror."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.source_ast import parse_source

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("appliance", "cli", "tui")
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400
MAX_INIT_PARAMETERS = 8
MAX_FOLDER_MODULES = 15


def breaches(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            found.append(f"{name}: {len(text.splitlines())} lines > {MAX_MODULE_LINES}")
        for node in ast.walk(parse_source(text, name)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{name}: {node.name} is {lines} lines")
                if node.name == "__init__":
                    n = len(node.args.args) - 1 + len(node.args.kwonlyargs)
                    if n > MAX_INIT_PARAMETERS:
                        found.append(f"{name}:{node.lineno} __init__ takes {n} parameters")
    for folder in sorted({root, *(p for p in root.rglob("*") if p.is_dir())}):
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > MAX_FOLDER_MODULES:
            name = folder.relative_to(root).as_posix()
            found.append(f"{name}/: {len(modules)} modules > {MAX_FOLDER_MODULES}")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_keeps_the_size_rules(package: str) -> None:
    assert breaches(ROOT / package) == []


def test_the_size_check_can_fail(tmp_path: Path) -> None:
    long_body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "wide.py").write_text(
        "class C:\n    def __init__(self, a, b, c, d, e, f, g, h, i):\n        pass\n\n"
        f"def f():\n{long_body}\n"
    )
    (tmp_path / "long.py").write_text("\n" * (MAX_MODULE_LINES + 1))
    crowded = tmp_path / "crowded"
    crowded.mkdir()
    for k in range(MAX_FOLDER_MODULES + 1):
        (crowded / f"m{k}.py").write_text("")
    (crowded / "__init__.py").write_text("")
    found = breaches(tmp_path)
    assert len(found) == 4, found
    assert any("takes 9 parameters" in f for f in found)
    assert any("f is 61 lines" in f for f in found)
    assert any("long.py: 401 lines" in f for f in found)
    assert "crowded/: 16 modules > 15" in found
