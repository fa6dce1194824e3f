"""Scale to zero, live: `appliance up` on one worker with `worker_reaper.worker_idle_s: 5`.

An idle worker is put to rest (on vLLM's CPU build, which has no sleep mode: stopped, its
process ended; on the simulated engine stopped, or with `worker_reaper.max_wake_s: 5` asleep
at vLLM's sleep level 2, the cheapest state that wakes within 5 s), its awake GPU-seconds stop
growing, a turn whose deadline is shorter than the wake is refused before any worker
starts, and the next turns wake it and succeed, their time to first token holding the
measured wake. Two turns that arrive while it is down cause one wake. The ledger's
`worker_power_events` rows say what happened, how long each change took and how long the
worker was in the state it left.
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.running import Started, add_key, appliance_process, eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
IDLE_S = 5.0


@dataclass
class Resting:
    up: Started
    key: str
    ops: str
    model: str
    ledger: Path
    engine: str
    rest: str
    """The state the worker is put to, as the ledger names it."""

    def turn(self, session: str) -> dict[str, Any]:
        """A non-streamed turn; its reply gains `client_s`: the seconds the client waited."""
        sent = time.monotonic()
        r = httpx.post(
            f"{self.up.url}/v1/chat/completions",
            json={
                "model": self.model,
                "max_tokens": 4,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": f"hello from {session}"}],
            },
            headers={"Authorization": f"Bearer {self.key}", "X-Session-ID": session},
            timeout=600,
        )
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body | {"client_s": time.monotonic() - sent}

    def state(self) -> dict[str, Any]:
        r = httpx.get(
            f"{self.up.url}/admin/v1/state",
            headers={"Authorization": f"Bearer {self.ops}"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        state: dict[str, Any] = r.json()
        return state

    def worker(self) -> dict[str, Any]:
        worker: dict[str, Any] = self.state()["workers"][0]
        return worker

    def rows(self, sql: str, *args: object) -> list[tuple[Any, ...]]:
        with closing(sqlite3.connect(self.ledger)) as db:
            return db.execute(sql, args).fetchall()

    def power_rows(self) -> list[tuple[str, str, str, float, float]]:
        return [
            (a, f, t, d, s)
            for a, f, t, d, s in self.rows(
                "SELECT action, from_state, to_state, duration_s, state_s"
                " FROM worker_power_events ORDER BY event_id"
            )
        ]


CASES = {
    "vllm": ("vllm", "stopped", {}),
    # A stopped simulated worker models a model load of the profile's ~41 s: a tenth here.
    "sim-stopped": ("sim", "stopped", {"APPLIANCE_ENGINE__SIM_TIME_SCALE": "0.1"}),
    "sim-asleep": ("sim", "asleep-2", {"APPLIANCE_WORKER_REAPER__MAX_WAKE_S": "5"}),
}
FROM = {"stopped": "stopped", "asleep-2": "sleep level 2"}
HURRY_S = {"stopped": "5", "asleep-2": "1"}
"""A deadline shorter than the GPU profile's wake from each state (43 s; 2.7 s)."""


@pytest.fixture(
    scope="module",
    params=[pytest.param("vllm", marks=pytest.mark.vllm), "sim-stopped", "sim-asleep"],
)
def resting(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Resting]:
    engine, rest, extra = CASES[request.param]
    data_dir = tmp_path_factory.mktemp(f"scale-to-zero-{request.param}")
    key, ops = add_key(data_dir, "alice"), add_key(data_dir, "ops", "--admin")
    model_dir = request.getfixturevalue("tiny_model_dir")
    env = {
        "APPLIANCE_WORKER_REAPER__WORKER_IDLE_S": str(IDLE_S),
        "APPLIANCE_ENGINE__MODEL": str(model_dir),
        "APPLIANCE_ENGINE__MAX_MODEL_LEN": "4096",
        **extra,
    }
    if engine == "vllm":
        env["APPLIANCE_ENGINE__PYTHON"] = request.getfixturevalue("vllm_python")
        env["APPLIANCE_ENGINE__KV_CACHE_MEMORY_BYTES"] = str(8 << 20)
    with appliance_process(data_dir, engine=engine, workers=1, env=env) as up:
        yield Resting(up, key, ops, model_dir.name, data_dir / "ledger.db", request.param, rest)


def test_an_idle_worker_stops_and_the_next_turns_wake_it_once(resting: Resting) -> None:
    app = resting
    app.turn("before")
    served = time.monotonic()
    stopped = eventually(app.power_rows, lambda rows: len(rows) == 1, timeout_s=60)
    rested_after = time.monotonic() - served
    action = "stop" if app.rest == "stopped" else "sleep"
    assert stopped[0][:3] == (action, "awake", app.rest), stopped
    assert IDLE_S - 0.5 <= rested_after <= IDLE_S + 10, rested_after
    assert stopped[0][4] >= IDLE_S  # awake since start: at least the idle wait
    down = eventually(app.worker, lambda w: not w["healthy"])
    # While it rests, its awake GPU-seconds do not grow.
    awake = down["gpu_busy_s"] + down["gpu_idle_s"]
    time.sleep(2)
    later = app.worker()
    assert later["gpu_busy_s"] + later["gpu_idle_s"] == pytest.approx(awake, abs=0.01)
    # A turn whose deadline is shorter than the wake is refused before any worker starts.
    r = httpx.post(
        f"{app.up.url}/v1/chat/completions",
        timeout=60,
        json={
            "model": app.model,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "in a hurry"}],
        },
        headers={"Authorization": f"Bearer {app.key}", "X-Deadline-S": HURRY_S[app.rest]},
    )
    assert r.status_code == 429 and r.json()["error"]["code"] == "deadline_infeasible", r.text
    announced = re.search(r"\(wake (\d+\.\d+) s", r.json()["error"]["message"])
    assert announced is not None, r.text
    assert len(app.power_rows()) == 1 and not app.worker()["healthy"]  # nothing woke
    # Two turns while it is down: one wake, both served, each waited for it.
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(app.turn, ["first", "second"]))
    assert all(r["choices"] for r in replies)
    rows = eventually(app.power_rows, lambda rows: len(rows) >= 2)
    wakes = [r for r in rows if r[0] == "wake"]
    assert len(wakes) == 1, rows
    _, was, now_in, wake_s, rested_s = wakes[0]
    assert (was, now_in) == (app.rest, "awake")
    assert rested_s >= 2 and wake_s > 0
    if app.engine.startswith("sim"):  # the wake it announced is the simulator's, time-scaled
        assert 0.5 * wake_s <= float(announced[1]) <= 2 * wake_s, (announced[1], wake_s)
    # The events feed says the same: one rest, one wake, the wake's measured seconds.
    events = app.state()["events"]
    woken = [e["detail"] for e in events if e["kind"] == "worker_woken"]
    assert woken == [f"woke from {FROM[app.rest]} in {wake_s:.2f} s"], events
    rest = "worker_stopped" if app.rest == "stopped" else "worker_slept"
    assert sum(e["kind"] == rest for e in events) == 1, events
    # The ledger's turn: its wait before forwarding (queue_s) holds the wake, so its time to
    # first token as the client saw it (queue_s + ttft_s) does; the client waited as long.
    turns = app.rows("SELECT queue_s + ttft_s FROM turns WHERE session_id IN ('first', 'second')")
    seen = [t for (t,) in turns]
    assert len(seen) == 2 and min(seen) >= 0.9 * wake_s, (seen, wake_s)
    assert min(r["client_s"] for r in replies) >= 0.9 * wake_s
    print(
        f"{app.engine}: {app.rest} {rested_after:.1f} s after its last turn; woken in "
        f"{wake_s:.1f} s; the two turns' time to first token {sorted(seen)} s"
    )
    assert app.worker()["healthy"]
