"""How a hold ends, live: `appliance up` on one worker with a small KV pool and a maximum
residency of a few seconds, on the simulated workers and on vLLM's CPU build.

A worker applies the reaper's directives at its next scheduler step (an idle one when its
next request comes, before it is admitted) and then reports what it holds, which is what
the appliance's view shows; so the test reads that view after a small turn of another
session, as on a worker with other traffic.

An abandoned session (its turn ended with a short `api` wait, and it never comes back) is
held from its turn's end until the maximum residency, and not after: the appliance's view
says so, the ledger has the reaper's decisions with their causes, and a flood of other
prompts then takes its blocks (its next turn finds next to nothing cached), which the
flood could not have done had the worker kept holding them. A worker killed while it holds
a session comes back holding nothing: the appliance's view says so within one poll of the
workers' health (`SupervisorTimings.health_interval_s`), the worker is started again (on
the simulated engine too), its retention connector says hello as a new incarnation, and
the session's KV is recorded as lost with the worker.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest

from appliance.engines.supervision.supervisor import SupervisorTimings
from appliance.services.residency.reaper_loop import TICK_S
from tests.e2e.test_reaper import (
    KV_BYTES,
    POOL_TOKENS,
    SIM_KV_BYTES_PER_TOKEN,
    Reaped,
    cached,
    flood,
    prompt_tokens,
    text,
)
from tests.running import Started, add_key, appliance_process, eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
MAX_RESIDENCY_S = 6.0
"""Long enough for a kill while the hold stands, short enough to wait out."""
API_WAIT = {"X-Tool-Class": "api", "X-Expected-Tool-Wait-S": "1"}
APPROVAL = {"X-Tool-Class": "approval", "X-Expected-Tool-Wait-S": "3600"}
WORDS = 160  # about 800 tokens of the tiny model's tokenizer
POLL_S = 0.05
"""How often the test reads the appliance's view while the worker is down."""


class Ending(Reaped):
    up: Started
    engine: str

    def state(self) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/admin/v1/state", headers={"Authorization": f"Bearer {self.ops}"})
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    def held(self, session: str) -> int:
        return int(self.session(session)["session"]["resident_tokens"]["gpu_held"])

    def residency(self, session: str) -> list[tuple[str, str, str | None, float | None]]:
        """The session's residency rows: action, reason, kind, idle seconds at the time."""
        rows = self.rows(
            "SELECT action, reason, json_extract(figures, '$.kind'),"
            " json_extract(figures, '$.idle_s') FROM residency_events"
            " WHERE session_id = ? ORDER BY at, event_id",
            f"alice/{session}",
        )
        return [(a, r, k, i) for a, r, k, i in rows]


@pytest.fixture(scope="module", params=["sim", pytest.param("vllm", marks=pytest.mark.vllm)])
def ending(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Ending]:
    data_dir = tmp_path_factory.mktemp(f"reaper-ends-{request.param}")
    key, ops = add_key(data_dir, "alice"), add_key(data_dir, "ops", "--admin")
    model_dir = request.getfixturevalue("tiny_model_dir")  # the sim takes its tokenizer
    env = {
        "APPLIANCE_RESIDENCY__MAX_RESIDENCY_S": str(MAX_RESIDENCY_S),
        "APPLIANCE_ENGINE__MODEL": str(model_dir),
        "APPLIANCE_ENGINE__MAX_MODEL_LEN": "4096",
        "APPLIANCE_LOG_LEVEL": "DEBUG",
    }
    if request.param == "vllm":
        env["APPLIANCE_ENGINE__PYTHON"] = request.getfixturevalue("vllm_python")
        env["APPLIANCE_ENGINE__KV_CACHE_MEMORY_BYTES"] = str(KV_BYTES)
    else:
        env["APPLIANCE_ENGINE__KV_CACHE_MEMORY_BYTES"] = str(POOL_TOKENS * SIM_KV_BYTES_PER_TOKEN)
    with appliance_process(data_dir, engine=request.param, workers=1, env=env) as up:
        app = Ending(
            up.url,
            key,
            ops,
            model_dir.name,
            f"http://127.0.0.1:{up.base_port}",
            data_dir / "ledger.db",
        )
        app.up, app.engine = up, request.param
        yield app


def step(app: Ending) -> None:
    """A small turn of another session: the worker takes a scheduler step, where its
    connector applies the directives it was sent (an idle worker applies them when its next
    request comes, before admitting it) and reports what it holds."""
    app.turn("ticker", [{"role": "user", "content": text(20, 10)}], **APPROVAL)


def held_then_released(app: Ending, session: str, timeout_s: float) -> tuple[int, float]:
    """Reads the session's view, a step before each read, until it is held and then not:
    (reads before it was first seen held, when it was first seen not held again)."""
    reads, seen_held = 0, False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        step(app)
        n = app.held(session)
        if n > 0:
            seen_held = True
        elif seen_held:
            return reads, time.monotonic()
        reads += 0 if seen_held else 1
    pytest.fail(f"{session}: held {seen_held}, and not released in {timeout_s} s")


def test_an_abandoned_sessions_hold_ends_at_the_maximum_residency(ending: Ending) -> None:
    app = ending
    messages = [{"role": "user", "content": text(21, WORDS)}]
    first = app.turn("abandoned", messages, **API_WAIT)
    ended = time.monotonic()
    n = prompt_tokens(first)
    unheld_reads, released = held_then_released(app, "abandoned", MAX_RESIDENCY_S + 10)
    print(
        f"{app.engine}: {n} tokens held from the first step after the turn, released "
        f"{released - ended:.2f}s after it (maximum residency {MAX_RESIDENCY_S:g}s)"
    )
    assert unheld_reads == 0  # held at the first step after its turn, and on until released
    assert MAX_RESIDENCY_S - 0.5 <= released - ended <= MAX_RESIDENCY_S + TICK_S + 1.0
    view = app.session("abandoned")["session"]
    # Evicted, or already seen gone: an abandoned session whose KV the KV index shows gone
    # is no longer followed (the watch runs every second, and the ticks evict it at once).
    assert view["decision"] in ("evict", None) and view["held_until"] is None, view
    # Held until the reaper ended it there: the session is not coming back within the
    # maximum residency (at its last revisit, the horizon left is a sliver), then past it.
    rows = eventually(
        lambda: app.residency("abandoned"),
        lambda r: any(kind == "max_residency" for _, _, kind, _ in r),
    )
    actions = [action for action, _, _, _ in rows]
    end = actions.index("evict")
    assert end > 0 and set(actions[:end]) == {"hold"}, rows
    _, _, kind, idle_s = rows[end]
    assert kind in ("not_returning", "max_residency") and idle_s is not None, rows[end]
    assert idle_s >= MAX_RESIDENCY_S - 0.5, rows[end]
    reasons = [reason for _, reason, kind, _ in rows if kind == "max_residency"]
    assert reasons and "maximum residency" in reasons[0], rows
    # Nothing holds its blocks now: other sessions' prompts take them.
    statuses = flood(app, WORDS, n)
    assert set(statuses) == {200}, statuses
    messages += [first["choices"][0]["message"], {"role": "user", "content": text(22, 20)}]
    again = app.turn("abandoned", messages, **API_WAIT)
    print(f"{app.engine}: after a flood of {len(statuses)}: {cached(again)} of {n} cached")
    assert cached(again) <= 0.1 * n


def worker_process(app: Ending) -> psutil.Process:
    """The worker's own process: the appliance's child serving the worker's port."""
    port = str(app.up.base_port)
    (proc,) = [
        p
        for p in psutil.Process(app.up.proc.pid).children()
        if "--port" in p.cmdline() and port in p.cmdline()
    ]
    return proc


def connectors(app: Ending) -> list[str]:
    """The retention connectors that said hello to the appliance, oldest first."""
    said = [line for line in app.up.log.read_text().splitlines() if "retention connector" in line]
    return [line.rsplit(" ", 1)[-1] for line in said]


def test_a_worker_killed_while_holding_comes_back_holding_nothing(ending: Ending) -> None:
    app = ending
    poll_s = SupervisorTimings().health_interval_s
    messages = [{"role": "user", "content": text(31, WORDS)}]
    first = app.turn("killed", messages, **API_WAIT)
    n = prompt_tokens(first)
    step(app)
    assert app.held("killed") >= 0.9 * n
    victim, hello = worker_process(app), connectors(app)
    killed = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(10)
    while app.held("killed") > 0 and time.monotonic() - killed < 10 * poll_s:
        time.sleep(POLL_S)
    shown = time.monotonic() - killed
    back = eventually(
        app.state,
        lambda s: s["workers"][0]["restarts"] == 1 and s["workers"][0]["healthy"],
        timeout_s=180,
    )
    restarted = time.monotonic() - killed
    print(
        f"{app.engine}: not held {shown:.2f}s after SIGKILL (one poll: {poll_s:g}s); "
        f"back in {restarted:.1f}s"
    )
    assert shown <= poll_s
    assert back["workers"][0]["restarts"] == 1
    new = connectors(app)
    assert len(new) == len(hello) + 1 and new[-1] not in hello, (hello, new)
    assert worker_process(app).pid != victim.pid
    view = app.session("killed")
    assert view["session"]["resident_tokens"]["gpu_held"] == 0, view
    lost = eventually(
        lambda: app.residency("killed"), lambda r: any(a == "evicted" for a, _, _, _ in r)
    )
    assert [kind for a, _, kind, _ in lost if a == "evicted"] == ["worker_lost"], lost
    messages += [first["choices"][0]["message"], {"role": "user", "content": text(32, 20)}]
    again = app.turn("killed", messages, **API_WAIT)
    print(f"{app.engine}: its next turn: {cached(again)} of {n} cached")
    assert cached(again) <= 0.1 * n


def task(app: Ending, task_id: str, parent: str | None = None) -> None:
    r = httpx.post(
        f"{app.url}/v1/tasks",
        json={"task_id": task_id, "parent_task_id": parent},
        headers={"Authorization": f"Bearer {app.key}"},
    )
    assert r.status_code == 201, r.text


def tasks_kv(app: Ending, prefix: str) -> dict[str, dict[str, Any]]:
    return {t["id"]: t for t in app.state()["tasks"] if t["id"].startswith(prefix)}


def test_a_fan_outs_ended_branches_keep_nothing_of_their_own_and_the_parent_still_hits(
    ending: Ending,
) -> None:
    """Issue 24: four children that start from their parent's conversation and add their
    own: the state shows each one's KV as inherited and its own; when they end, their own
    held KV is reclaimed within a reaper tick (well before the maximum residency would have
    let it go), the state and the ledger say what was reclaimed when, and the parent's
    prefix still hits."""
    app, kids = ending, [f"fan-k{i}" for i in range(4)]
    task(app, "fan")
    parent = [{"role": "user", "content": text(41, WORDS)}]
    first = app.turn("fan-root", parent, **{"X-Task-ID": "fan"}, **API_WAIT)
    n = prompt_tokens(first)
    context = [*parent, first["choices"][0]["message"]]
    for i, kid in enumerate(kids):
        task(app, kid, "fan")
        own = [*context, {"role": "user", "content": text(50 + i, 60)}]
        app.turn(kid, own, **{"X-Task-ID": kid}, **API_WAIT)

    def stepped() -> dict[str, dict[str, Any]]:
        # A vLLM worker reports holds at its next scheduler step: a one-token request of no
        # session (which nothing holds, so the branches' holds stay under the pool's cap).
        nudge = {"model": app.model, "prompt": "nudge", "max_tokens": 1}
        httpx.post(
            f"{app.url}/v1/completions",
            json=nudge,
            timeout=60,
            headers={"Authorization": f"Bearer {app.key}"},
        )
        return tasks_kv(app, "fan")

    shown = eventually(stepped, lambda t: all(t[k]["kv_own_kept_tokens"] > 0 for k in kids))
    for kid in kids:
        view = shown[kid]
        assert 0.8 * n <= view["kv_inherited_tokens"] <= n, view  # the parent's full blocks
        assert view["kv_own_tokens"] >= 128 and view["kv_reclaimed_tokens"] is None, view
    assert shown["fan"]["kv_inherited_tokens"] == 0 and shown["fan"]["kv_own_tokens"] >= 0.8 * n
    closed: dict[str, float] = {}
    for kid in kids:
        closed[kid] = time.time()
        r = httpx.post(
            f"{app.url}/v1/tasks/{kid}/events",
            json={"type": "succeeded"},
            headers={"Authorization": f"Bearer {app.key}"},
        )
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + MAX_RESIDENCY_S - 1
    while time.monotonic() < deadline:
        after = stepped()
        if all(after[k]["kv_own_kept_tokens"] == 0 and after[k]["kv_reclaimed_at"] for k in kids):
            break
    else:
        pytest.fail(f"ended branches still keep their own KV: {after}")
    ended = dict(
        app.rows(
            "SELECT session_id, at FROM residency_events WHERE json_extract(figures, '$.kind')"
            " = 'session_ended' AND session_id LIKE 'alice/fan-k%'"
        )
    )
    assert sorted(ended) == [f"alice/{k}" for k in kids]
    for kid in kids:
        at = ended[f"alice/{kid}"]
        assert closed[kid] <= at <= closed[kid] + TICK_S + 1.0, (kid, at - closed[kid])  # a tick
        own, inherited = app.rows(
            "SELECT json_extract(figures, '$.own_tokens'),"
            " json_extract(figures, '$.inherited_tokens') FROM residency_events"
            " WHERE session_id = ? AND json_extract(figures, '$.kind') = 'session_ended'",
            f"alice/{kid}",
        )[0]
        view = after[kid]
        assert (view["kv_reclaimed_tokens"], view["kv_reclaimed_at"]) == (own, at), view
        assert own > 0 and inherited >= 0.8 * n
    lag = max(ended[f"alice/{k}"] - closed[k] for k in kids)
    print(f"{app.engine}: {len(kids)} branches ended; own KV reclaimed <= {lag:.2f}s after each")
    again = app.turn(
        "fan-root",
        [*context, {"role": "user", "content": text(60, 10)}],
        **{"X-Task-ID": "fan"},
        **API_WAIT,
    )
    assert cached(again) >= 0.9 * (n // 32 * 32), (cached(again), n)


def test_a_prompt_over_the_window_ends_its_sessions_hold_at_once(ending: Ending) -> None:
    """A harness whose next prompt overflows the window gets a 400 and compacts: the turn
    before it left the session held for a short tool wait, and the refusal ends that hold
    within a reaper tick, well before the maximum residency, for the reason it was."""
    app = ending
    messages = [{"role": "user", "content": text(71, WORDS)}]
    first = app.turn("compacting", messages, **API_WAIT)
    n = prompt_tokens(first)
    assert app.held_for("compacting", n // 32 * 32) > 0
    over = [*messages, first["choices"][0]["message"], {"role": "user", "content": text(72, 900)}]
    refused_at = time.time()
    r = httpx.post(
        f"{app.url}/v1/chat/completions",
        json={"model": app.model, "messages": over, "max_tokens": 8},
        headers={"Authorization": f"Bearer {app.key}", "X-Session-ID": "compacting"},
        timeout=300,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    rows = eventually(
        lambda: app.rows(
            "SELECT at, reason FROM residency_events WHERE session_id = ?"
            " AND json_extract(figures, '$.kind') = 'session_ended'",
            "alice/compacting",
        ),
        bool,
    )
    (at, reason), *_ = rows
    assert "its next prompt overflowed the window" in reason, rows
    assert refused_at <= at <= refused_at + TICK_S + 1.0 < refused_at + MAX_RESIDENCY_S

    def stepped_held() -> int:
        step(app)  # the worker applies the directive at its next step
        return app.held("compacting")

    assert eventually(stepped_held, lambda held: held == 0) == 0
