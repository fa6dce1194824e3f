"""The appliance killed with SIGKILL and started again on the same ports and data dir: it
binds at once, and the open tasks and sessions come back from its ledger (robustness
fault 3: they were `not found`, and creating one again was a 500)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.running import add_key, appliance_process

pytestmark = pytest.mark.e2e


def test_open_tasks_and_sessions_come_back_after_a_kill(tmp_path: Path) -> None:
    key = add_key(tmp_path, "agent")
    ops = add_key(tmp_path, "ops", "--admin")
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi " * 200}],
            "max_tokens": 4}  # fmt: skip
    with appliance_process(tmp_path, workers=1) as first:
        assert httpx.post(f"{first.url}/v1/tasks", json={"task_id": "long"},
                          headers=auth).status_code == 201  # fmt: skip
        turn = httpx.post(f"{first.url}/v1/chat/completions", json=body, timeout=60,
                          headers={**auth, "X-Task-ID": "long", "X-Session-ID": "s1"})  # fmt: skip
        assert turn.status_code == 200
        time.sleep(0.3)  # the turn's rows are committed within milliseconds of the answer
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        killed_at = time.monotonic()
        ports = first.ports
    with appliance_process(tmp_path, workers=1, ports=ports) as second:
        # Healthy again on the same ports: nothing kept them (the sim worker takes ~2 s).
        assert time.monotonic() - killed_at < 30
        task = httpx.get(f"{second.url}/v1/tasks/long", headers=auth).json()
        assert (task["status"], task["turns"]) == ("open", 1)
        # A retried creation is the task it made; another task of that name is refused.
        again = httpx.post(f"{second.url}/v1/tasks", json={"task_id": "long"}, headers=auth)
        assert again.status_code == 200 and again.json()["status"] == "open"
        other = {"task_id": "long", "task_class": "other"}
        clash = httpx.post(f"{second.url}/v1/tasks", json=other, headers=auth)
        assert clash.status_code == 409 and clash.json()["error"]["code"] == "task_exists"
        state = httpx.get(f"{second.url}/admin/v1/state",
                          headers={"Authorization": f"Bearer {ops}"}).json()  # fmt: skip
        session = next(s for s in state["sessions"] if s["id"] == "s1")
        assert (session["tenant"], session["worker"], session["task_id"]) == ("agent", "w0", "long")
        later = httpx.post(f"{second.url}/v1/chat/completions", json=body, timeout=60,
                           headers={**auth, "X-Task-ID": "long", "X-Session-ID": "s1"})  # fmt: skip
        assert later.status_code == 200 and later.headers["x-appliance-worker"] == "w0"
