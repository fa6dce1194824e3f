"""`residency.policy` live: `appliance up --engine sim` on one worker, started once with
`residency.policy: lru` and once with the default (the reaper). A session's turn ends with a
short `api` wait; the ledger's residency rows on it then carry the policy's decision: LRU's
release (kind `lru`) on the first box, the reaper's hold (kind `pool_free`: the pool has
room) on the second."""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_reaper import POOL_TOKENS, SIM_KV_BYTES_PER_TOKEN, text
from tests.running import add_key, appliance_process, eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
API_WAIT = {"X-Tool-Class": "api", "X-Expected-Tool-Wait-S": "1"}


def _decisions(ledger: Path, session: str) -> list[tuple[str, str | None]]:
    """The residency rows on the session: (action, kind)."""
    with closing(sqlite3.connect(ledger)) as db:
        rows = db.execute(
            "SELECT action, figures FROM residency_events WHERE session_id LIKE ? ORDER BY rowid",
            (f"%/{session}",),
        ).fetchall()
    return [(a, json.loads(f).get("kind") if f else None) for a, f in rows]


@pytest.mark.parametrize(
    ("policy", "expected"), [("lru", ("release", "lru")), (None, ("hold", "pool_free"))]
)
def test_the_box_runs_the_policy_its_setting_names(
    policy: str | None,
    expected: tuple[str, str],
    tmp_path: Path,
    tiny_model_dir: Path,
) -> None:
    key = add_key(tmp_path, "alice")
    env = {
        "APPLIANCE_ENGINE__MODEL": str(tiny_model_dir),
        "APPLIANCE_ENGINE__MAX_MODEL_LEN": "4096",
        "APPLIANCE_ENGINE__KV_CACHE_MEMORY_BYTES": str(POOL_TOKENS * SIM_KV_BYTES_PER_TOKEN),
    }
    if policy is not None:
        env["APPLIANCE_RESIDENCY__POLICY"] = policy
    with appliance_process(tmp_path, engine="sim", workers=1, env=env) as up:
        r = httpx.post(
            f"{up.url}/v1/chat/completions",
            json={
                "model": tiny_model_dir.name,
                "messages": [{"role": "user", "content": text(7, 160)}],
                "max_tokens": 8,
                "ignore_eos": True,
            },
            headers={"Authorization": f"Bearer {key}", "X-Session-ID": "s1", **API_WAIT},
            timeout=300,
        )
        assert r.status_code == 200, r.text
        rows = eventually(lambda: _decisions(tmp_path / "ledger.db", "s1"), bool, timeout_s=30)
    assert rows and rows[0] == expected, rows
