"""The appliance killed with SIGKILL under load and started again on the same ports and data
dir: it serves again within seconds of its start (issue 15 asks 2 s; see below), every turn
answered 200 before the kill has its ledger row, and the open tasks and sessions come back
from its ledger (robustness fault 3: they were `not found`, and creating one again was a
500)."""

from __future__ import annotations

import signal
import sqlite3
import threading
import time
from contextlib import closing
from pathlib import Path

import httpx
import pytest

from tests.running import add_key, appliance_process

pytestmark = pytest.mark.e2e


def test_open_tasks_and_sessions_come_back_after_a_kill(tmp_path: Path) -> None:
    key = add_key(tmp_path, "agent")
    ops = add_key(tmp_path, "ops", "--admin")
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi " * 200}], "max_tokens": 4}
    with appliance_process(tmp_path, workers=1) as first:
        assert (
            httpx.post(f"{first.url}/v1/tasks", json={"task_id": "long"}, headers=auth).status_code
            == 201
        )
        turn = httpx.post(
            f"{first.url}/v1/chat/completions",
            json=body,
            timeout=60,
            headers={**auth, "X-Task-ID": "long", "X-Session-ID": "s1"},
        )
        assert turn.status_code == 200
        done = httpx.post(
            f"{first.url}/v1/chat/completions",
            json=body,
            timeout=60,
            headers={**auth, "X-Task-ID": "done"},
        )
        assert done.status_code == 200
        closing_event = {"type": "succeeded", "verified": True}
        assert (
            httpx.post(
                f"{first.url}/v1/tasks/done/events", json=closing_event, headers=auth
            ).status_code
            == 200
        )
        time.sleep(0.3)  # the turn's rows are committed within milliseconds of the answer
        answered, clients = under_load(first.url, auth, body)
        first.proc.send_signal(signal.SIGKILL)  # while the clients send
        first.proc.wait(10)
        for c in clients:
            c.join(15)
        ports = first.ports
    assert len(answered) >= 4, answered  # the kill came under load
    with closing(sqlite3.connect(tmp_path / "ledger.db")) as db:
        ok = {r[0] for r in db.execute("SELECT session_id FROM turns WHERE outcome = 'ok'")}
    assert set(answered) <= ok, f"answered without a ledger row: {set(answered) - ok}"
    began = time.monotonic()
    with appliance_process(tmp_path, workers=1, ports=ports) as second:
        # The same port answers again within 2 s of the start (its API binds first and
        # says `starting` until its worker serves); healthy, its sim worker included, soon
        # after: on this 2-core machine two interpreters start in turn (the appliance,
        # ~0.5-1.0 s of imports, then its sim worker, ~0.5-0.8 s), so that bound is 4 s.
        restarted_s = time.monotonic() - began
        print(
            f"port answered {second.first_answer_s:.2f} s, healthy {restarted_s:.2f} s "
            f"after the start; /health said {second.health_seen}"
        )
        assert second.first_answer_s < 2.0
        assert restarted_s < 4.0, restarted_s
        task = httpx.get(f"{second.url}/v1/tasks/long", headers=auth).json()
        assert (task["status"], task["turns"]) == ("open", 1)
        # A retried creation is the task it made; another task of that name is refused.
        again = httpx.post(f"{second.url}/v1/tasks", json={"task_id": "long"}, headers=auth)
        assert again.status_code == 200 and again.json()["status"] == "open"
        other = {"task_id": "long", "task_class": "other"}
        clash = httpx.post(f"{second.url}/v1/tasks", json=other, headers=auth)
        assert clash.status_code == 409 and clash.json()["error"]["code"] == "task_exists"
        state = httpx.get(
            f"{second.url}/admin/v1/state", headers={"Authorization": f"Bearer {ops}"}
        ).json()
        session = next(s for s in state["sessions"] if s["id"] == "s1")
        assert (session["tenant"], session["worker"], session["task_id"]) == ("agent", "w0", "long")
        # A task closed before the kill is the ledger's: shown, and closed to turns and
        # to a creation of that name (a turn made it anew, then a 500: a UNIQUE clash).
        shown = httpx.get(f"{second.url}/v1/tasks/done", headers=auth).json()
        assert (shown["status"], shown["verified"], shown["turns"]) == ("succeeded", True, 1)
        refused = httpx.post(
            f"{second.url}/v1/chat/completions",
            json=body,
            timeout=60,
            headers={**auth, "X-Task-ID": "done"},
        )
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "task_closed"
        retried = httpx.post(f"{second.url}/v1/tasks", json={"task_id": "done"}, headers=auth)
        assert retried.status_code == 200 and retried.json()["status"] == "succeeded"
        remade = {"task_id": "done", "task_class": "other"}
        clashed = httpx.post(f"{second.url}/v1/tasks", json=remade, headers=auth)
        assert clashed.status_code == 409 and clashed.json()["error"]["code"] == "task_exists"
        later = httpx.post(
            f"{second.url}/v1/chat/completions",
            json=body,
            timeout=60,
            headers={**auth, "X-Task-ID": "long", "X-Session-ID": "s1"},
        )
        assert later.status_code == 200 and later.headers["x-appliance-worker"] == "w0"


def under_load(
    url: str, auth: dict[str, str], body: dict[str, object]
) -> tuple[list[str], list[threading.Thread]]:
    """Four clients send turns, each in a session of its own, until the appliance dies
    under them; returns after a second of it (the kill comes now). The sessions of the
    turns answered 200 (filled in until the clients end), and the clients."""
    answered: list[str] = []

    def client(n: int) -> None:
        for i in range(10**6):
            session = f"load-{n}-{i}"
            try:
                r = httpx.post(
                    f"{url}/v1/chat/completions",
                    json=body,
                    timeout=10,
                    headers={**auth, "X-Session-ID": session},
                )
            except httpx.HTTPError:
                return  # the appliance died under it
            if r.status_code == 200:
                answered.append(session)

    clients = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(4)]
    for c in clients:
        c.start()
    time.sleep(1.0)
    return answered, clients
