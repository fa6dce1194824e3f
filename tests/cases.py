"""Tables of cases, one row per case: what the test is given, then what it expects."""

from __future__ import annotations


def case(given: object, expected: tuple[object, ...]) -> tuple[object, ...]:
    """One row: `given` (a tuple of the test's inputs, or its one input) then `expected`."""
    return (*given, *expected) if isinstance(given, tuple) else (given, *expected)
