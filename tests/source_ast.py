"""Python source parsed for the tests that read it (sizes, unique names, the console's imports)."""

from __future__ import annotations

import ast
import gc


def parse_source(text: str, filename: str = "<unknown>") -> ast.Module:
    """`ast.parse` with the garbage collector paused: CPython 3.11 raises "AST constructor
    recursion depth mismatch" when a finalizer runs Python code while it builds the tree
    (python/cpython#106905; here an earlier test's unretrieved asyncio task exception,
    logged by its `__del__`, failed CI once)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(text, filename)
    finally:
        if enabled:
            gc.enable()
