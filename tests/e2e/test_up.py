"""The appliance end to end on two workers (simulated, and real vLLM), driven by the unchanged
`openai` client."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import sqlite3
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import httpx
import openai
import pytest

from appliance.engines.clients.metrics import parse as parse_metrics
from appliance.policy.routing import RouteKind
from tests.e2e.conftest import BIN, RunningAppliance
from tests.running import add_key, await_running
from tests.words import GREEK, numbered_words

pytestmark = pytest.mark.e2e


def text(seed: int, n_words: int) -> str:
    """Words no other seed shares a prefix with, so every test controls its own cache hits."""
    return numbered_words(random.Random(seed), n_words, letters=GREEK[:14], numbers=1000)


def client(app: RunningAppliance, who: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.url}/v1", api_key=app.keys[who], max_retries=0)


def turn(
    app: RunningAppliance,
    c: openai.OpenAI,
    messages: list[dict[str, str]],
    session: str,
    max_tokens: int = 8,
    **kw: object,
):  # type: ignore[no-untyped-def]
    raw = c.chat.completions.with_raw_response.create(
        model=app.model,
        messages=messages,
        max_tokens=max_tokens,  # type: ignore[arg-type]
        extra_headers={"X-Session-ID": session},
        extra_body={"ignore_eos": True},
        **kw,
    )
    return raw.headers["x-appliance-worker"], raw.parse()


def route_decisions(app: RunningAppliance, session: str) -> str:
    """The session's route decisions from the ledger, a line each (worker, reason,
    candidates): what a failed placement assertion shows."""
    time.sleep(0.5)  # the ledger writer's batch
    with closing(sqlite3.connect(app.ledger)) as db:
        rows = db.execute(
            "SELECT r.worker, r.reason, r.candidates FROM route_decisions r"
            " JOIN turns t USING (turn_id) WHERE t.session_id LIKE ? ORDER BY r.at",
            (f"%{session}",),
        )
        return "\n".join(" ".join(row) for row in rows)


def test_its_port_says_starting_until_its_workers_serve(appliance_up: RunningAppliance) -> None:
    """The API binds before the workers start: a vLLM worker takes tens of seconds here, and
    the port says `starting` (503) all that time, then `ok`; a simulated worker may be up
    before the first look."""
    seen = appliance_up.health_seen
    assert seen[-1] == "ok" and set(seen) <= {"starting", "ok"}, seen
    if appliance_up.engine == "vllm":
        assert seen == ["starting", "ok"]


def test_a_ten_turn_session_stays_on_its_worker_and_its_cache_grows(
    appliance_up: RunningAppliance,
) -> None:
    app = appliance_up
    c = client(appliance_up)
    messages = [{"role": "system", "content": text(1, app.words(300))}]
    workers, cached = [], []
    for i in range(10):
        messages.append({"role": "user", "content": text(100 + i, app.words(60))})
        worker, answer = turn(app, c, messages, "ten-turns")
        workers.append(worker)
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        cached.append(answer.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
    assert len(set(workers)) == 1, f"{workers}\n{route_decisions(app, 'ten-turns')}"
    assert cached[0] == 0
    assert all(b > a for a, b in itertools.pairwise(cached)), cached


def test_streaming_passes_through_with_usage(appliance_up: RunningAppliance) -> None:
    app = appliance_up
    c = client(appliance_up)
    stream = c.chat.completions.create(
        model=app.model,
        messages=[{"role": "user", "content": text(7, app.words(50))}],
        max_tokens=12,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    deltas = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    usage = [ch.usage for ch in chunks if ch.usage is not None]
    # vLLM may hold back a token whose text is not complete yet, so deltas can be fewer.
    assert 0 < len(deltas) <= 12
    assert usage and usage[-1].completion_tokens == 12
    assert usage[-1].prompt_tokens_details is not None


def test_a_client_that_leaves_a_stream_midway_cancels_its_turn(
    appliance_up: RunningAppliance,
) -> None:
    app = appliance_up
    body = {
        "model": app.model,
        "messages": [{"role": "user", "content": text(8, app.words(50))}],
        "max_tokens": 1000,
        "stream": True,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {app.keys['alice']}", "X-Session-ID": "leaver"}
    with httpx.stream(
        "POST", f"{app.url}/v1/chat/completions", json=body, headers=headers, timeout=60
    ) as response:
        assert response.status_code == 200
        next(response.iter_raw())  # the first chunk, then hang up
    assert _session_turns(app, "leaver", expect=1) == [(ANY_WORKER, "cancelled")]


def test_two_tenants_never_share_a_cache_entry(appliance_up: RunningAppliance) -> None:
    app = appliance_up
    prompt = [{"role": "user", "content": text(42, app.words(400))}]
    _, first = turn(app, client(appliance_up, "alice"), prompt, "tenant-a")
    _, again = turn(app, client(appliance_up, "alice"), prompt, "tenant-a")
    _, other = turn(app, client(appliance_up, "bob"), prompt, "tenant-a")  # same session id too
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]


def test_a_session_moves_off_an_overloaded_worker_and_the_ledger_says_why(
    appliance_up: RunningAppliance,
) -> None:
    app = appliance_up
    c = client(appliance_up)
    messages = [{"role": "user", "content": text(5, app.words(200))}]
    home, _ = turn(app, c, messages, "mover")
    home_port = app.base_port + int(home.removeprefix("w"))
    # Load the home worker behind the router's back, as another client would.
    flood_words = 6000 if app.engine == "sim" else 3000  # the tiny real model has 4k context
    flood = {"model": app.model, "max_tokens": 4, "ignore_eos": True}
    for i in range(2):  # the worker's own counters now show what its requests are like
        httpx.post(
            f"http://127.0.0.1:{home_port}/v1/completions",
            json={**flood, "prompt": text(900 + i, app.words(flood_words))},
            timeout=60,
        )
    with ThreadPoolExecutor(24) as pool:
        futures = [
            pool.submit(
                httpx.post,
                f"http://127.0.0.1:{home_port}/v1/completions",
                json={**flood, "prompt": text(1000 + i, app.words(flood_words))},
                timeout=120,
            )
            for i in range(24)
        ]
        time.sleep(1.5)  # the appliance reads the workers' /metrics twice a second
        messages.append({"role": "user", "content": text(6, app.words(20))})
        moved_to, _ = turn(app, c, messages, "mover")
        for f in futures:
            f.result()
    assert moved_to != home
    with closing(sqlite3.connect(app.ledger)) as db:
        reasons = [
            r
            for (r,) in db.execute(
                "SELECT reason FROM route_decisions WHERE worker = ? ORDER BY at DESC LIMIT 5",
                (moved_to,),
            )
        ]
    assert any(r.startswith("moved: ") and f"moved from {home}" in r for r in reasons), reasons


def test_bad_requests_are_refused_before_any_worker(appliance_up: RunningAppliance) -> None:
    app = appliance_up
    url = f"{app.url}/v1/chat/completions"
    good = {"Authorization": f"Bearer {app.keys['alice']}"}
    msg = [{"role": "user", "content": "hi"}]
    cases = [
        ({}, {"model": app.model, "messages": msg}, 401, "invalid_api_key"),
        (
            {"Authorization": "Bearer nope"},
            {"model": app.model, "messages": msg},
            401,
            "invalid_api_key",
        ),
        (good, "{not json", 400, "invalid_json"),
        (good, {"model": "other", "messages": msg}, 404, "model_not_found"),
        (good, {"model": app.model, "messages": "hi"}, 400, "invalid_type"),
        (good, {"model": app.model, "messages": msg, "max_tokens": 0}, 400, "invalid_value"),
        (good, {"model": app.model, "messages": msg, "max_tokens": "8"}, 400, "invalid_type"),
        (
            good,
            {
                "model": app.model,
                "messages": [{"role": "user", "content": text(3, app.words(80000))}],
            },
            400,
            "context_length_exceeded",
        ),
        (
            {**good, "X-Deadline-S": "soon"},
            {"model": app.model, "messages": msg},
            400,
            "invalid_header",
        ),
        (good, "x" * (10 * 2**20), 413, "body_too_large"),
        # Each of these answered 500 once (robustness fault 5) or passed unchecked (fault 9).
        (
            good,
            {"model": app.model, "messages": msg, "stream": True, "stream_options": [1]},
            400,
            "invalid_type",
        ),
        (good, {"model": app.model, "messages": msg, "x": _nested(600)}, 400, "invalid_json"),
        (
            good,
            {"model": app.model, "messages": msg, "session_id": "s" * 10_000},
            400,
            "invalid_value",
        ),
        (good, {"model": app.model, "messages": msg, "session_id": "a\nb"}, 400, "invalid_value"),
        (
            {**good, "X-Task-ID": "me", "X-Parent-Task-ID": "me"},
            {"model": app.model, "messages": msg},
            400,
            "invalid_header",
        ),
        (
            {**good, "X-Task-ID": "orphan", "X-Parent-Task-ID": "nobody"},
            {"model": app.model, "messages": msg},
            404,
            "task_not_found",
        ),
        # Sizes a client sets, bounded before a worker sees them (fault 1: n = 10^9 grew a
        # worker by 100 MB/s until it was killed).
        (good, {"model": app.model, "messages": msg, "n": 10**9}, 400, "limit_exceeded"),
        (good, {"model": app.model, "messages": msg, "best_of": 17}, 400, "limit_exceeded"),
        (good, {"model": app.model, "messages": msg, "stop": ["x"] * 17}, 400, "limit_exceeded"),
        (good, {"model": app.model, "messages": msg, "top_logprobs": 21}, 400, "limit_exceeded"),
        (good, {"model": app.model, "messages": msg, "tools": [{}] * 129}, 400, "limit_exceeded"),
    ]
    completion = f"{app.url}/v1/completions"
    too_big = httpx.post(completion, json={"model": app.model, "prompt": [2**63]}, headers=good)
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "prompt"
    before = _routed(appliance_up)
    for headers, body, status, code in cases:
        data = body if isinstance(body, str) else json.dumps(body)
        r = httpx.post(url, content=data, headers=headers, timeout=30)
        assert r.status_code == status, (body if isinstance(body, dict) else body[:20], r.text)
        err = r.json()["error"]
        assert err["code"] == code and err["message"] and err["type"]
    assert _routed(appliance_up) == before  # nothing reached a worker


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def test_bad_task_requests_change_nothing(appliance_up: RunningAppliance) -> None:
    """Each answered 500, or was taken as it came (faults 5 and 9): now a 400 or 404 naming
    the field, and neither the task book nor the ledger changes."""
    app = appliance_up
    auth = {"Authorization": f"Bearer {app.keys['bob']}"}
    tasks = f"{app.url}/v1/tasks"
    assert httpx.post(tasks, json={"task_id": "kept"}, headers=auth).status_code == 201
    for body, status, param in [
        ({"task_id": "b1", "budget": {"usd": 1}}, 400, "budget"),
        ({"task_id": "b2", "budget": [1]}, 400, "budget"),
        ({"task_id": "b3", "budget": -1}, 400, "budget"),
        ({"task_id": "me", "parent_task_id": "me"}, 400, "parent_task_id"),
        ({"task_id": "a\u0000b"}, 400, "task_id"),
        ({"task_id": "t" * 257}, 400, "task_id"),
        ({"task_id": "orphan", "parent_task_id": "nobody"}, 404, "parent_task_id"),
    ]:
        r = httpx.post(tasks, json=body, headers=auth)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), (body, r.text)
    for body, param in [
        ({"type": "tool_started", "tool_class": 5}, "tool_class"),
        ({"type": "tool_started", "expected_s": "soon"}, "expected_s"),
        ({"type": "succeeded", "evidence": {"tests": "passed"}}, "evidence"),
    ]:
        r = httpx.post(f"{tasks}/kept/events", json=body, headers=auth)
        assert (r.status_code, r.json()["error"]["param"]) == (400, param), (body, r.text)
    assert httpx.get(f"{tasks}/kept", headers=auth).json()["status"] == "open"
    with closing(sqlite3.connect(app.ledger)) as db:
        rows = db.execute("SELECT task_id, status FROM tasks WHERE tenant = 'bob'").fetchall()
        events = db.execute(
            "SELECT COUNT(*) FROM task_events WHERE task_id = 'bob/kept'"
        ).fetchone()
    assert ("bob/kept", "open") in rows
    assert not {t for t, _ in rows} & {"bob/b1", "bob/b2", "bob/b3", "bob/me", "bob/orphan"}
    assert events == (0,)


def test_keys_added_and_revoked_take_effect_without_a_restart(
    appliance_up: RunningAppliance,
) -> None:
    app = appliance_up
    body = {"model": app.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    url = f"{app.url}/v1/chat/completions"
    alice = {"Authorization": f"Bearer {app.keys['alice']}", "X-Session-ID": "stays"}
    assert httpx.post(url, json=body, headers=alice, timeout=60).status_code == 200
    carol = {"Authorization": f"Bearer {add_key(app.data_dir, 'carol')}"}
    assert _status_within(url, body, carol, 200) == 200
    revoked = subprocess.run(
        [str(BIN / "appliance"), "keys", "revoke", "carol", "--data-dir", str(app.data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert revoked.returncode == 0, revoked.stderr
    assert _status_within(url, body, carol, 401) == 401
    # Nobody else was dropped: the other tenant's session goes on, on the same process.
    assert httpx.post(url, json=body, headers=alice, timeout=60).status_code == 200
    assert app.proc.poll() is None
    # An operator key may send model turns too: they count as the tenant named after it.
    ops = {"Authorization": f"Bearer {app.keys['ops']}", "X-Session-ID": "operator-check"}
    assert httpx.post(url, json=body, headers=ops, timeout=60).status_code == 200
    assert _session_turns(app, "operator-check", expect=1) == [(ANY_WORKER, "ok")]
    with closing(sqlite3.connect(app.ledger)) as db:
        tenants = db.execute(
            "SELECT DISTINCT tenant FROM turns WHERE session_id = 'operator-check'"
        ).fetchall()
    assert tenants == [("ops",)]


def _status_within(url: str, body: dict[str, object], headers: dict[str, str], want: int) -> int:
    """The status of a request repeated until it is `want`, for up to 5 s."""
    deadline = time.monotonic() + 5
    while True:
        status = httpx.post(url, json=body, headers=headers, timeout=60).status_code
        if status == want or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


def test_retry_duplicates_a_client_may_retry_a_creation_or_a_closing_event(
    appliance_up: RunningAppliance,
) -> None:
    """After a timeout a client cannot tell whether its request landed: the same request
    again is answered as the first was, and recorded once. The seed failure mode "retry
    duplicates"."""
    app = appliance_up
    auth = {"Authorization": f"Bearer {app.keys['bob']}"}
    tasks = f"{app.url}/v1/tasks"
    body = {"task_id": "retried", "task_class": "retrying"}
    assert httpx.post(tasks, json=body, headers=auth).status_code == 201
    assert httpx.post(tasks, json=body, headers=auth).status_code == 200
    done = {"type": "succeeded", "verified": True}
    for _ in range(2):
        r = httpx.post(f"{tasks}/retried/events", json=done, headers=auth)
        assert (r.status_code, r.json()["status"]) == (200, "succeeded")
    other = httpx.post(f"{tasks}/retried/events", json={"type": "succeeded"}, headers=auth)
    assert other.status_code == 409  # not the same event: unverified after verified
    late = httpx.post(
        f"{app.url}/v1/chat/completions",
        json={"model": app.model, "messages": [{"role": "user", "content": "more"}]},
        headers={**auth, "X-Task-ID": "retried"},
    )  # a closed task takes no more turns (the task issue: they were served)
    assert (late.status_code, late.json()["error"]["code"]) == (409, "task_closed")
    with closing(sqlite3.connect(app.ledger)) as db:
        (tasks_rows,) = db.execute("SELECT COUNT(*) FROM tasks WHERE task_id = 'bob/retried'")
        (events,) = db.execute("SELECT COUNT(*) FROM task_events WHERE task_id = 'bob/retried'")
    assert (tasks_rows, events) == ((1,), (1,))


def test_cancelling_a_task_stops_its_turns_in_flight(appliance_up: RunningAppliance) -> None:
    """Cancel used to stop nothing: the task's requests kept running on the workers."""
    app = appliance_up
    auth = {"Authorization": f"Bearer {app.keys['alice']}"}
    long = {
        "model": app.model,
        "max_tokens": 2000,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": text(90, app.words(40))}],
    }
    url = f"{app.url}/v1/chat/completions"
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(
            httpx.post,
            url,
            json=long,
            timeout=120,
            headers={**auth, "X-Task-ID": "stopme", "X-Session-ID": "stop1"},
        )
        _await_running_anywhere(app)
        r = httpx.post(f"{app.url}/v1/tasks/stopme/cancel", headers=auth)
        assert r.json()["cancelled"] == ["stopme"]
        answer = waiting.result(timeout=60)
    assert (answer.status_code, answer.json()["error"]["code"]) == (409, "task_cancelled")
    assert _session_turns(app, "stop1", expect=1) == [(ANY_WORKER, "cancelled")]
    streamed = {**long, "stream": True}
    headers = {**auth, "X-Task-ID": "stopme2", "X-Session-ID": "stop2"}
    with httpx.stream("POST", url, json=streamed, headers=headers, timeout=120) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        httpx.post(f"{app.url}/v1/tasks/stopme2/cancel", headers=auth)
        rest = [line for line in lines if line.startswith("data:")]
    assert any('"task_cancelled"' in line for line in rest), rest[-3:]
    assert _session_turns(app, "stop2", expect=1) == [(ANY_WORKER, "cancelled")]


def test_cancelling_a_root_ends_a_grandchilds_stream_within_a_second(
    appliance_up: RunningAppliance,
) -> None:
    """Issue 19: a root's cancellation reaches down its tree to a grandchild's streamed turn
    in flight: the stream ends within 1 s of the cancel's answer with a cancelled event, the
    worker lets go of the request, and no task of the tree takes another turn."""
    app = appliance_up
    auth = {"Authorization": f"Bearer {app.keys['alice']}"}
    tasks = f"{app.url}/v1/tasks"
    tree = [("gc-root", None), ("gc-child", "gc-root"), ("gc-grandchild", "gc-child")]
    for task, parent in tree:
        r = httpx.post(tasks, json={"task_id": task, "parent_task_id": parent}, headers=auth)
        assert r.status_code == 201, r.text
    body = {
        "model": app.model,
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
        "messages": [{"role": "user", "content": text(95, app.words(40))}],
    }
    headers = {**auth, "X-Task-ID": "gc-grandchild", "X-Session-ID": "gc-stream"}
    url = f"{app.url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200
        index = int(response.headers["x-appliance-worker"].removeprefix("w"))
        worker = f"http://127.0.0.1:{app.base_port + index}"
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        await_running(worker)
        with ThreadPoolExecutor(1) as pool:  # read on while the cancel is sent
            rest = pool.submit(
                lambda: ([ln for ln in lines if ln.startswith("data:")], time.monotonic())
            )
            r = httpx.post(f"{tasks}/gc-root/cancel", headers=auth, timeout=30)
            answered = time.monotonic()
            data, ended = rest.result(timeout=60)
    assert sorted(r.json()["cancelled"]) == sorted(t for t, _ in tree)
    print(f"[{app.engine}] the stream ended {ended - answered:.3f} s after the cancel's answer")
    assert ended - answered < 1.0, f"the stream ended {ended - answered:.3f} s after the cancel"
    assert '"task_cancelled"' in data[-1], data[-3:]
    assert _until_running(worker, 0, timeout_s=10) == 0, "the worker still runs the turn"
    for task, _ in tree:
        late = httpx.post(
            url,
            json={**body, "stream": False, "max_tokens": 4},
            headers={**auth, "X-Task-ID": task},
            timeout=60,
        )
        assert (late.status_code, late.json()["error"]["code"]) == (409, "task_closed"), task
        # Nor does the tree grow: a new child of any of them, made or opened by a turn.
        r = httpx.post(
            tasks, json={"task_id": f"{task}-late", "parent_task_id": task}, headers=auth
        )
        assert (r.status_code, r.json()["error"]["code"]) == (409, "task_closed"), r.text
        late = httpx.post(
            url,
            json={**body, "stream": False, "max_tokens": 4},
            timeout=60,
            headers={**auth, "X-Task-ID": f"{task}-new", "X-Parent-Task-ID": task},
        )
        assert (late.status_code, late.json()["error"]["code"]) == (409, "task_closed"), task
    assert _session_turns(app, "gc-stream", expect=1) == [(ANY_WORKER, "cancelled")]
    with closing(sqlite3.connect(app.ledger)) as db:
        turns = db.execute("SELECT COUNT(*) FROM turns WHERE task_id LIKE 'alice/gc-%'").fetchone()
        tasks_rows = db.execute("SELECT COUNT(*) FROM tasks WHERE task_id LIKE 'alice/gc-%'")
        assert tasks_rows.fetchone() == (3,)  # no child was opened under the closed tree
    assert turns == (1,)  # the late turns reached no worker


def test_a_roots_success_discards_its_open_branches_and_ends_their_turns(
    appliance_up: RunningAppliance,
) -> None:
    """Issue 19: no live code marked a fan-out branch discarded. A root that succeeds
    without its open children closes them: a child's streamed turn in flight ends with a
    `task_discarded` event and is recorded `discarded`; a child that succeeded stays so."""
    app = appliance_up
    auth = {"Authorization": f"Bearer {app.keys['alice']}"}
    tasks = f"{app.url}/v1/tasks"
    for task, parent in [("bo-root", None), ("bo-won", "bo-root"), ("bo-lost", "bo-root")]:
        r = httpx.post(tasks, json={"task_id": task, "parent_task_id": parent}, headers=auth)
        assert r.status_code == 201, r.text
    won = {"type": "succeeded", "verified": True}
    assert httpx.post(f"{tasks}/bo-won/events", json=won, headers=auth).status_code == 200
    body = {
        "model": app.model,
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
        "messages": [{"role": "user", "content": text(96, app.words(40))}],
    }
    headers = {**auth, "X-Task-ID": "bo-lost", "X-Session-ID": "bo-stream"}
    url = f"{app.url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as response:
        index = int(response.headers["x-appliance-worker"].removeprefix("w"))
        worker = f"http://127.0.0.1:{app.base_port + index}"
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        await_running(worker)
        r = httpx.post(f"{tasks}/bo-root/events", json=won, headers=auth, timeout=30)
        data = [line for line in lines if line.startswith("data:")]
    assert r.json() == {"task_id": "bo-root", "status": "succeeded", "discarded": ["bo-lost"]}
    assert '"task_discarded"' in data[-1], data[-3:]
    assert _until_running(worker, 0, timeout_s=10) == 0, "the worker still runs the turn"
    assert _session_turns(app, "bo-stream", expect=1) == [(ANY_WORKER, "discarded")]
    with closing(sqlite3.connect(app.ledger)) as db:
        sql = "SELECT task_id, status, evidence FROM tasks WHERE task_id LIKE 'alice/bo-%'"
        rows = db.execute(f"{sql} ORDER BY task_id").fetchall()
    assert rows == [
        ("alice/bo-lost", "cancelled", "discarded: bo-root succeeded"),
        ("alice/bo-root", "succeeded", None),
        ("alice/bo-won", "succeeded", None),
    ]


def test_deadline_blind_admission_a_child_past_its_parents_2_s_deadline_is_refused(
    appliance_up: RunningAppliance,
) -> None:
    """Issue 19, on both engines: a child made under a parent with a 2 s deadline inherits
    it, so once those 2 s are spent its turn cannot finish by then and is refused before a
    worker sees it (tests/e2e/test_deadlines.py refuses one whose prefill alone is too long)."""
    app = appliance_up
    auth = {"Authorization": f"Bearer {app.keys['alice']}"}
    tasks = f"{app.url}/v1/tasks"
    r = httpx.post(tasks, json={"task_id": "dl-parent", "deadline_s": 2}, headers=auth)
    assert r.status_code == 201, r.text
    child = {"task_id": "dl-child", "parent_task_id": "dl-parent", "deadline_s": 600}
    r = httpx.post(tasks, json=child, headers=auth)
    assert r.status_code == 201, r.text
    due_at = r.json()["deadline_at"]
    time.sleep(max(0.0, due_at - time.time()) + 0.1)
    body = {
        "model": app.model,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": text(97, app.words(20))}],
    }
    late = httpx.post(
        f"{app.url}/v1/chat/completions",
        json=body,
        timeout=60,
        headers={**auth, "X-Task-ID": "dl-child"},
    )
    assert (late.status_code, late.json()["error"]["code"]) == (429, "deadline_passed")
    with closing(sqlite3.connect(app.ledger)) as db:
        turns = db.execute("SELECT COUNT(*) FROM turns WHERE task_id = 'alice/dl-child'")
        assert turns.fetchone() == (0,)


def _until_running(worker_url: str, want: float, timeout_s: float) -> float:
    """The worker's running count (its own /metrics), polled until it is `want`."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = parse_metrics(httpx.get(f"{worker_url}/metrics", timeout=5).text)
        running = metrics.total("vllm:num_requests_running")
        if running == want or time.monotonic() > deadline:
            return running
        time.sleep(0.02)


def _await_running_anywhere(app: RunningAppliance) -> None:
    """Until some worker says it runs a request (its own /metrics)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for i in range(2):
            metrics = httpx.get(f"http://127.0.0.1:{app.base_port + i}/metrics", timeout=5).text
            if parse_metrics(metrics).total("vllm:num_requests_running") >= 1:
                return
        time.sleep(0.02)
    pytest.fail("no worker ran the turn")


def test_the_routers_own_time_per_turn_is_on_metrics(appliance_up: RunningAppliance) -> None:
    app = appliance_up
    before = _forward_histogram(app)
    c = client(appliance_up)
    messages = [{"role": "user", "content": text(11, app.words(60))}]
    for i in range(3):
        turn(app, c, messages, "timed")
        messages.append({"role": "user", "content": text(12 + i, app.words(10))})
    after = _forward_histogram(app)
    assert after["count"] - before["count"] == 3
    assert 0 < after["sum"] - before["sum"] < 3.0
    buckets = [after[k] for k in after if k.startswith("le=")]
    assert buckets == sorted(buckets) and buckets[-1] == after["count"]  # cumulative, +Inf last
    routed = parse_metrics(httpx.get(f"{app.url}/metrics").text).by_label(
        "appliance_routed_turns_total", "reason"
    )
    # The label is the decision's kind: a fixed set, whatever the figures behind it.
    assert routed and set(routed) <= {k.value for k in RouteKind}


def test_each_workers_prefill_speed_is_measured_from_its_own_histograms(
    appliance_up: RunningAppliance,
) -> None:
    """Sequential turns leave the worker calm between readings: its request-level prefill
    histograms give the router a measured slowdown against the GPU profile."""
    app = appliance_up
    c = client(appliance_up)
    messages = [{"role": "system", "content": text(21, app.words(200))}]
    served = set()
    for i in range(6):
        messages.append({"role": "user", "content": text(22 + i, app.words(30))})
        served.add(turn(app, c, messages, "speed")[0])
        messages.append({"role": "assistant", "content": "ok"})
    ops = {"Authorization": f"Bearer {app.keys['ops']}"}

    def read() -> tuple[dict[str, float], dict[str, float]]:
        """The slowdowns in the state and on /metrics, read one after the other."""
        state = httpx.get(f"{app.url}/admin/v1/state", headers=ops).json()
        text_ = httpx.get(f"{app.url}/metrics").text
        gauge = parse_metrics(text_, only=["appliance_worker_prefill_slowdown"])
        return (
            {w["id"]: w["prefill_slowdown"] for w in state["workers"]},
            {w: gauge.total("appliance_worker_prefill_slowdown", worker=w) for w in served},
        )

    # The daemon reads the workers twice a second, and a later reading may move the value
    # between the two requests: wait until a reading has it and both sources agree.
    deadline = time.monotonic() + 10
    slowdown, metric = read()
    while time.monotonic() < deadline:
        measured = all(slowdown[w] != 1.0 for w in served)
        if measured and all(metric[w] == pytest.approx(slowdown[w], rel=1e-3) for w in served):
            break
        time.sleep(0.25)
        slowdown, metric = read()
    assert all(0 < slowdown[w] != 1.0 for w in served), (served, slowdown)
    assert all(metric[w] == pytest.approx(slowdown[w], rel=1e-3) for w in served), metric


def _forward_histogram(app: RunningAppliance) -> dict[str, float]:
    series = [f"appliance_forward_seconds_{s}" for s in ("bucket", "sum", "count")]
    samples = parse_metrics(httpx.get(f"{app.url}/metrics").text, only=series).samples
    return {
        f"le={s.labels['le']}" if "le" in s.labels else s.name.rsplit("_", 1)[1]: s.value
        for s in samples
    }


def _routed(app: RunningAppliance) -> int:
    text_ = httpx.get(f"{app.url}/metrics").text
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text_.splitlines()
        if line.startswith("appliance_routed_turns_total")
    )


def test_a_killed_worker_costs_one_failed_attempt_and_the_session_goes_on(
    appliance_up: RunningAppliance,
) -> None:
    """The worker dies while it holds the turn (a long answer, not streamed, so no byte has
    reached the client): that attempt fails, and the turn is served by the other worker."""
    app = appliance_up
    c = client(appliance_up)
    messages = [{"role": "user", "content": text(9, app.words(100))}]
    home, _ = turn(app, c, messages, "survivor")
    import psutil

    port = app.base_port + int(home.removeprefix("w"))
    victim = next(
        p
        for p in psutil.Process(app.proc.pid).children(recursive=True)
        if "--port" in p.cmdline() and str(port) in p.cmdline()
    )
    messages.append({"role": "user", "content": text(10, app.words(20))})
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(turn, app, c, messages, "survivor", max_tokens=2000)
        await_running(f"http://127.0.0.1:{port}")
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(10)
        other, answer = pending.result(timeout=120)
    assert other != home and answer.choices
    rows = _session_turns(appliance_up, "survivor", expect=3)
    assert rows == [(home, "ok"), (home, "failed"), (other, "ok")], rows


class _AnyWorker(str):
    def __eq__(self, other: object) -> bool:
        return isinstance(other, str) and other.startswith("w")

    __hash__ = str.__hash__


ANY_WORKER = _AnyWorker("w?")


def _session_turns(app: RunningAppliance, session: str, expect: int) -> list[tuple[str, str]]:
    """The session's turn rows; the ledger commits a turn within milliseconds of its answer."""
    deadline = time.monotonic() + 5
    while True:
        with closing(sqlite3.connect(app.ledger)) as db:
            rows = db.execute(
                "SELECT worker, outcome FROM turns WHERE session_id = ? ORDER BY started_at",
                (session,),
            ).fetchall()
        if len(rows) >= expect or time.monotonic() > deadline:
            return [tuple(r) for r in rows]
        time.sleep(0.05)


def test_a_verified_task_closes_the_loop_to_cost_per_success(
    appliance_up: RunningAppliance,
) -> None:
    app = appliance_up
    auth = {"Authorization": f"Bearer {app.keys['bob']}"}
    r = httpx.post(
        f"{app.url}/v1/tasks",
        headers=auth,
        json={"task_id": "fix-bug", "task_class": "swe", "deadline_s": 600},
    )
    assert r.status_code == 201 and r.json()["task_id"] == "fix-bug"
    c = client(appliance_up, "bob")
    for i in range(2):
        c.chat.completions.create(
            model=app.model,
            messages=[{"role": "user", "content": text(70 + i, app.words(50))}],
            max_tokens=4,
            extra_headers={"X-Task-ID": "fix-bug", "X-Session-ID": "fix-bug"},
        )
    done = httpx.post(
        f"{app.url}/v1/tasks/fix-bug/events",
        headers=auth,
        json={"type": "succeeded", "verified": True},
    )
    assert done.json()["status"] == "succeeded"
    again = httpx.post(f"{app.url}/v1/tasks/fix-bug/events", headers=auth, json={"type": "failed"})
    assert again.status_code == 409
    task = httpx.get(f"{app.url}/v1/tasks/fix-bug", headers=auth).json()
    assert task["status"] == "succeeded" and task["turns"] == 2
    assert task["tokens"]["prompt"] > 0 and task["tokens"]["output"] == 8
    with closing(sqlite3.connect(app.ledger)) as db:
        receipts = db.execute(
            "SELECT token_count, runtime_identity, tier FROM cache_receipts"
            " WHERE tenant_domain = 'bob'"
        ).fetchall()
    assert receipts and all(n > 0 and tier == "gpu" for n, _, tier in receipts)
    assert all(f"bs{32}" in identity for _, identity, _ in receipts)
    ops = {"Authorization": f"Bearer {app.keys['ops']}"}
    assert httpx.get(f"{app.url}/admin/v1/costs", headers=auth).status_code == 403
    deadline = time.monotonic() + 5
    while True:
        rows = httpx.get(f"{app.url}/admin/v1/costs", headers=ops).json()["costs"]
        swe = [r for r in rows if r["task_class"] == "swe" and r["tenant"] == "bob"]
        if (swe and swe[0]["attempts"] >= 2) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    # Two turns; a retried attempt (a worker that failed before its first byte) counts too.
    assert swe[0]["succeeded"] == 1 and swe[0]["attempts"] >= 2
    assert swe[0]["cost_per_success"] == pytest.approx(swe[0]["cost"]) and swe[0]["cost"] > 0
    # Reading the report must not disturb the ledger's writer (POSIX locks are per process).
    turn(app, c, [{"role": "user", "content": text(79, app.words(20))}], "after-report")
    assert _session_turns(app, "after-report", expect=1) == [(ANY_WORKER, "ok")]


def test_status_sessions_and_tasks_read_the_running_appliance(
    appliance_up: RunningAppliance,
) -> None:
    app = appliance_up
    turn(app, client(app), [{"role": "user", "content": text(77, 30)}], "listed")
    base = [str(BIN / "appliance"), "--url", app.url, "--data-dir", str(app.data_dir)]

    def cli(command: str, *extra: str) -> subprocess.CompletedProcess[str]:
        args = [base[0], command, *base[1:], *extra]
        return subprocess.run(args, capture_output=True, text=True, timeout=60)

    status = cli("status")
    assert status.returncode == 0, status.stderr
    assert "w0" in status.stdout and "w1" in status.stdout
    sessions = json.loads(cli("sessions", "--json").stdout)["sessions"]
    assert any(s["id"] == "listed" for s in sessions)
    assert cli("tasks", "--tree").returncode == 0


def test_the_state_shows_only_numbers_the_ledger_supports(appliance_up: RunningAppliance) -> None:
    app = appliance_up
    c = client(app, "alice")
    messages = [{"role": "system", "content": text(301, app.words(200))}]
    for i in range(3):
        messages.append({"role": "user", "content": text(310 + i, app.words(40))})
        c.chat.completions.create(
            model=app.model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=6,
            extra_headers={"X-Session-ID": "audited", "X-Task-ID": "audit"},
            extra_body={"ignore_eos": True},
        )
        messages.append({"role": "assistant", "content": "ok"})
    _session_turns(app, "audited", expect=3)
    ops = {"Authorization": f"Bearer {app.keys['ops']}"}
    with closing(sqlite3.connect(app.ledger)) as db:
        tokens, cost, attempts = db.execute(
            "SELECT SUM(prompt_tokens) + SUM(output_tokens), SUM(cost), COUNT(*) FROM turns"
            " WHERE task_id = 'alice/audit'"
        ).fetchone()
        last_prompt, last_predicted, last_worker = db.execute(
            "SELECT prompt_tokens, predicted_cached_tokens, worker FROM turns"
            " WHERE session_id = 'audited' ORDER BY started_at DESC LIMIT 1"
        ).fetchone()
    # The KV index's view now: every full block of the last prompt is cached once its KV
    # events arrive (not the smaller view predicted when the last turn was placed).
    held = last_prompt // 32 * 32
    deadline = time.monotonic() + 5
    while True:
        state = httpx.get(f"{app.url}/admin/v1/state", headers=ops).json()
        session = next(s for s in state["sessions"] if s["id"] == "audited")
        if session["resident_tokens"]["gpu"] == held or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    task = next(t for t in state["tasks"] if t["id"] == "audit" and t["tenant"] == "alice")
    assert {w["engine"] for w in state["workers"]} == {app.engine}  # not "external" for sim
    assert attempts == 3
    assert task["tokens"] == tokens
    assert task["cost"] == pytest.approx(cost)
    assert session["turns"] == 3 and session["worker"] == last_worker
    tiers = dict(session["resident_tokens"])
    # Held in vLLM once its retention connector applies the reaper's hold (its next step).
    assert 0 <= tiers.pop("gpu_held") <= held
    assert tiers == {"gpu": held, "host": 0, "gone": 0}, (held, last_predicted)
    assert held > last_predicted > 0
    assert session["resident_bytes"]["gpu"] > 0 == session["resident_bytes"]["host"]
