"""One name, one thing: a top-level class (and a public top-level function) of appliance/,
tui/ or cli/ is defined in one module only, so a name in a signature or a traceback says
which one is meant without its import line. Module-private functions (`_read`) are the
module's own business and may repeat."""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

from tests.source_ast import parse_source

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("appliance", "tui", "cli")
Named = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef

PENDING: dict[str, frozenset[str]] = {}
"""Known repeats, each with exactly the modules that repeat it (none now: the console decodes
the admin API's own `...View` structs)."""


@functools.cache
def _top_level() -> list[tuple[str, ast.stmt]]:
    """(module path, top-level statement) for every module of the packages."""
    out: list[tuple[str, ast.stmt]] = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = path.relative_to(ROOT).as_posix()
            out += [(module, node) for node in parse_source(path.read_text(), module).body]
    return out


def _definitions(kinds: tuple[type[Named], ...], *, private: bool) -> dict[str, set[str]]:
    where: dict[str, set[str]] = defaultdict(set)
    for module, node in _top_level():
        if isinstance(node, kinds) and (private or not node.name.startswith("_")):
            where[node.name].add(module)
    return where


def _repeated(where: dict[str, set[str]]) -> dict[str, list[str]]:
    return {
        name: sorted(modules)
        for name, modules in sorted(where.items())
        if len(modules) > 1 and PENDING.get(name) != frozenset(modules)
    }


def test_each_class_name_is_defined_once() -> None:
    assert _repeated(_definitions((ast.ClassDef,), private=True)) == {}


def test_each_public_function_name_is_defined_once() -> None:
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    assert _repeated(_definitions(functions, private=False)) == {}


def test_the_known_repeats_are_still_repeats() -> None:
    """An entry of PENDING that no longer repeats is stale: remove it."""
    where = _definitions((ast.ClassDef,), private=True)
    assert {
        name for name, modules in PENDING.items() if frozenset(where.get(name, ())) != modules
    } == set()


def test_a_repeat_is_found() -> None:
    where = {"Clock": {"appliance/ports.py", "appliance/sim/runtime/clock.py"}, "Only": {"a.py"}}
    assert _repeated(where) == {"Clock": ["appliance/ports.py", "appliance/sim/runtime/clock.py"]}
