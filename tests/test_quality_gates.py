"""The quality gates run as part of the suite: lint, strict types on the pure core, and the
import contracts that keep dependencies pointing one way."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "check", "appliance", "tui", "cli", "tests", "benchmarks"],
        ["ruff", "format", "--check", "appliance", "tui", "cli", "tests", "benchmarks"],
        ["mypy", "appliance/domain", "appliance/policy"],
        ["lint-imports"],
    ],
    ids=["ruff", "ruff-format", "mypy-strict", "import-contracts"],
)
def test_gate(command: list[str]) -> None:
    r = subprocess.run(
        [str(BIN / command[0]), *command[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
