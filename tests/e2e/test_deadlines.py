"""Deadlines that bind, end to end against `appliance up --engine sim`: a turn still queued
at its task's deadline is aborted at the worker, answered 504 `deadline_missed` and recorded
as a cancelled attempt with that error. The seed failure mode "deadline-blind admission"."""

from __future__ import annotations

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

from appliance.engines.clients.metrics import parse as parse_metrics
from tests.running import add_key, appliance_process

pytestmark = pytest.mark.e2e

BLOCK = 32  # the configured default (engine.block_size)
KV_TOKENS = 4096 + BLOCK  # the null block too: a 4096-token sequence fits
KV_BYTES_PER_TOKEN = 131072  # the bundled H200 profile's


@dataclass
class App:
    url: str
    auth: dict[str, str]
    worker_url: str
    ledger: Path

    def completion(self, prompt: list[int], max_tokens: int, **headers: str) -> httpx.Response:
        body = {"model": "sim", "prompt": prompt, "max_tokens": max_tokens}
        return httpx.post(
            f"{self.url}/v1/completions", json=body, headers=self.auth | headers, timeout=60
        )

    def queued(self) -> float:
        """Requests the (only) worker runs or holds waiting, from its own /metrics."""
        metrics = parse_metrics(httpx.get(f"{self.worker_url}/metrics", timeout=10).text)
        return metrics.total("vllm:num_requests_running") + metrics.total(
            "vllm:num_requests_waiting"
        )

    def rows(self, sql: str) -> list[tuple[Any, ...]]:
        with closing(sqlite3.connect(self.ledger)) as db:
            return db.execute(sql).fetchall()


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    """One simulated worker whose KV cache holds 4096 tokens: one long request fills it,
    and the next waits in the worker's queue until it ends."""
    data_dir = tmp_path_factory.mktemp("appliance-deadlines")
    key = add_key(data_dir, "alice")
    env = {
        "APPLIANCE_ENGINE__MAX_MODEL_LEN": "4096",
        "APPLIANCE_ENGINE__KV_CACHE_MEMORY_BYTES": str(KV_TOKENS * KV_BYTES_PER_TOKEN),
    }
    with appliance_process(data_dir, workers=1, env=env) as up:
        auth = {"Authorization": f"Bearer {key}"}
        yield App(up.url, auth, f"http://127.0.0.1:{up.base_port}", data_dir / "ledger.db")


def _until(check: Any, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := check()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def test_deadline_blind_admission_a_turn_queued_past_its_deadline_is_aborted(app: App) -> None:
    """Admission judges a deadline by the prefill queued ahead of a turn; it cannot see a
    worker whose KV cache a long decode fills, so it lets in turns that then wait there past
    their deadline (here about 1000 decode steps). They used to wait it out, and be served
    when their task no longer had use for the answer; now each is aborted at the worker at
    its deadline, the client told at once, the attempt recorded, and the worker goes on."""
    body = {
        "model": "sim",
        "prompt": list(range(1000, 4000)),
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }
    blocker = {**app.auth, "X-Task-ID": "hog"}
    with httpx.stream(
        "POST", f"{app.url}/v1/completions", json=body, headers=blocker, timeout=60
    ) as hog:
        lines = hog.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # it runs: cache full
        r = httpx.post(
            f"{app.url}/v1/tasks", json={"task_id": "due", "deadline_s": 1.5}, headers=app.auth
        )
        assert r.status_code == 201, r.text
        due_at = r.json()["deadline_at"]
        stream = {"model": "sim", "prompt": [7] * 1200, "max_tokens": 4, "stream": True}
        with ThreadPoolExecutor(2) as pool:
            plain = pool.submit(app.completion, [5] * 1200, 4, **{"X-Task-ID": "due"})
            # A child opened by its first turn: under its parent's deadline.
            streamed = pool.submit(
                httpx.post,
                f"{app.url}/v1/completions",
                json=stream,
                headers=app.auth | {"X-Task-ID": "due-child", "X-Parent-Task-ID": "due"},
                timeout=60,
            )
            assert _until(lambda: app.queued() == 3), "the two turns did not queue"
            answers = [plain.result(timeout=30), streamed.result(timeout=30)]
        answered_at = time.time()
        for answer in answers:
            assert answer.status_code == 504, answer.text
            assert answer.json()["error"]["code"] == "deadline_missed"
        assert due_at <= answered_at < due_at + 2.0
        assert _until(lambda: app.queued() == 1), "the aborted requests stayed at the worker"
        sql = "SELECT outcome, error FROM turns WHERE task_id IN ('alice/due', 'alice/due-child')"
        assert _until(lambda: len(app.rows(sql)) == 2)
        assert app.rows(sql) == [("cancelled", "deadline_missed")] * 2
        r = httpx.post(f"{app.url}/v1/tasks/hog/cancel", headers=app.auth, timeout=10)
        assert r.json()["cancelled"] == ["hog"]
        assert any('"task_cancelled"' in line for line in lines)
    # The appliance goes on: a turn with time to spare is served.
    r = app.completion([9] * 1200, 4, **{"X-Task-ID": "spare", "X-Deadline-S": "30"})
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    """One simulated worker with a 64k context, where one prompt's prefill alone takes the
    bundled H200 profile about 3.4 s (60,000 tokens)."""
    data_dir = tmp_path_factory.mktemp("appliance-wide")
    key = add_key(data_dir, "alice")
    env = {"APPLIANCE_ENGINE__MAX_MODEL_LEN": "65536"}
    with appliance_process(data_dir, workers=1, env=env) as up:
        auth = {"Authorization": f"Bearer {key}"}
        yield App(up.url, auth, f"http://127.0.0.1:{up.base_port}", data_dir / "ledger.db")


def _served(app: App) -> float:
    metrics = parse_metrics(httpx.get(f"{app.worker_url}/metrics", timeout=10).text)
    return metrics.total("vllm:request_success_total")


def test_deadline_blind_admission_a_child_is_refused_a_turn_it_cannot_finish(wide: App) -> None:
    """Issue 19: a child created under a parent with a 2 s deadline inherits it, and its
    turn is refused up front when even its prefill cannot be done by then (about 3.4 s
    here): no worker sees it, and the ledger says why. Its short turn is served, and the
    same long turn is served under a deadline it can meet."""
    tasks = f"{wide.url}/v1/tasks"
    r = httpx.post(tasks, json={"task_id": "brief", "deadline_s": 2}, headers=wide.auth)
    assert r.status_code == 201, r.text
    due_at = r.json()["deadline_at"]
    child = {"task_id": "brief-child", "parent_task_id": "brief", "deadline_s": 60}
    r = httpx.post(tasks, json=child, headers=wide.auth)
    assert (r.status_code, r.json()["deadline_at"]) == (201, due_at), r.text
    before = _served(wide)
    long_prompt = [1000 + i % 20000 for i in range(60000)]
    refused = [
        wide.completion(long_prompt, 4, **{"X-Task-ID": "brief-child"}),
        # A child opened by its first turn meets the same refusal, and is not opened.
        wide.completion(long_prompt, 4, **{"X-Task-ID": "brief-kid", "X-Parent-Task-ID": "brief"}),
    ]
    for answer in refused:
        assert answer.status_code == 429, answer.text
        error = answer.json()["error"]
        assert error["code"] == "deadline_infeasible" and "prefill" in error["message"]
    short = wide.completion([3] * 1000, 4, **{"X-Task-ID": "brief-child"})
    assert short.status_code == 200, short.text
    assert wide.rows(
        "SELECT task_id, reason LIKE 'deadline_infeasible:%' FROM admission_events"
        " WHERE decision = 'deny' ORDER BY at"
    ) == [("alice/brief-child", 1), ("alice/brief-kid", 1)]
    assert wide.rows("SELECT COUNT(*) FROM tasks WHERE task_id = 'alice/brief-kid'") == [(0,)]
    sql = "SELECT COUNT(*) FROM turns WHERE task_id = 'alice/brief-child'"
    assert _until(lambda: wide.rows(sql) == [(1,)]), wide.rows(sql)  # the short one
    # The same long turn under a parent whose deadline it can meet is served.
    r = httpx.post(tasks, json={"task_id": "roomy", "deadline_s": 60}, headers=wide.auth)
    assert r.status_code == 201, r.text
    heads = {"X-Task-ID": "roomy-child", "X-Parent-Task-ID": "roomy"}
    served = wide.completion(long_prompt, 4, **heads)
    assert served.status_code == 200, served.text
    assert _served(wide) == before + 2
