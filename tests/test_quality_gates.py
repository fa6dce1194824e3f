"""The quality gates run as part of the suite: lint, strict types on the pure core, the
import contracts that keep dependencies pointing one way, and the mutation score of the
decision code held to its floor (scripts/mutation.py, about 3 minutes here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STRICT_TYPED = ["appliance/domain", "appliance/policy", "appliance/perf", "appliance/tokenization"]
"""The pure core, typed strictly (pyproject.toml's mypy overrides name the same packages)."""


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "check", "appliance", "tui", "cli", "tests", "benchmarks", "scripts"],
        ["ruff", "format", "--check", "appliance", "tui", "cli", "tests", "benchmarks", "scripts"],
        ["mypy", *STRICT_TYPED],
        ["lint-imports"],
        # About 3 minutes on a quiet 2-core machine; more while other work runs beside it.
        pytest.param(["python", "scripts/mutation.py"], marks=pytest.mark.timeout(1200)),
    ],
    ids=["ruff", "ruff-format", "mypy-strict", "import-contracts", "mutation-score"],
)
def test_gate(command: list[str]) -> None:
    r = subprocess.run(
        [str(BIN / command[0]), *command[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
