"""Robustness fault 2: on a full disk the ledger says so (`failing`) instead of losing writes
quietly, a probe commits only once there is room again, and writes then resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_a_full_disk_is_reported_until_a_probe_commits_again(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(HERE / "ledger_full_disk_proc.py"), str(tmp_path / "ledger.db")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=HERE.parent.parent,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout)
    assert seen["before"] is None
    assert seen["lost"] > 0 and seen["during"]  # every refused write was told, and why
    assert seen["probe_while_full"] == "refused"
    assert seen["after_probe"] is None  # room again: the probe committed and cleared it
