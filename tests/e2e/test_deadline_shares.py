"""A turn's share of its task's deadline, end to end against `appliance up --engine sim`:
once tasks of a class have succeeded, a turn of a task of that class with a deadline is
given the deadline less what the class is expected to need after the turn, and the answer
says both (`X-Appliance-Turn-Timeout-S`, `X-Appliance-Deadline-Reserve-S`). A restarted
appliance starts from the ledger's history of the class. Issue 40, item 5: a turn used to
be given the task's whole remaining deadline, leaving its remaining turns and tools none."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.running import add_key, appliance_process

pytestmark = pytest.mark.e2e

TOOLS_S = 0.4
"""What the class's tasks spend between their turns (their tools, as a client waits here)."""
CLOSE_S = 0.2
"""From a task's last turn to its success."""


@dataclass
class Client:
    url: str
    auth: dict[str, str]

    def task(self, task_id: str, **fields: object) -> float | None:
        """Creates the task; its deadline_at."""
        body = {"task_id": task_id, **fields}
        r = httpx.post(f"{self.url}/v1/tasks", json=body, headers=self.auth, timeout=30)
        assert r.status_code == 201, r.text
        deadline_at: float | None = r.json()["deadline_at"]
        return deadline_at

    def answer(self, task_id: str, **headers: str) -> httpx.Response:
        body = {"model": "sim", "prompt": [7] * 200, "max_tokens": 4}
        heads = self.auth | {"X-Task-ID": task_id} | headers
        r = httpx.post(f"{self.url}/v1/completions", json=body, headers=heads, timeout=30)
        assert r.status_code == 200, r.text
        return r

    def turn(self, task_id: str, **headers: str) -> tuple[float, float]:
        """One turn of the task: the seconds it was given, and those kept after it."""
        r = self.answer(task_id, **headers)
        given = r.headers["X-Appliance-Turn-Timeout-S"]
        return float(given), float(r.headers["X-Appliance-Deadline-Reserve-S"])

    def succeed(self, task_id: str) -> None:
        url = f"{self.url}/v1/tasks/{task_id}/events"
        r = httpx.post(url, json={"type": "succeeded"}, headers=self.auth, timeout=30)
        assert r.status_code == 200, r.text


def _run_class_task(client: Client, task_id: str) -> None:
    """A task of class `build`: 3 turns, TOOLS_S between them, CLOSE_S to its success."""
    client.task(task_id, task_class="build")
    for k in range(3):
        if k:
            time.sleep(TOOLS_S)
        client.answer(task_id)
    time.sleep(CLOSE_S)
    client.succeed(task_id)


def _shares(client: Client, task_id: str) -> list[tuple[float, float, float]]:
    """The three turns of a new 60 s task of class `build`: (seconds left to the deadline
    when each was sent, given, kept)."""
    deadline_at = client.task(task_id, task_class="build", deadline_s=60)
    assert deadline_at is not None
    out = []
    for k in range(3):
        if k:
            time.sleep(TOOLS_S)
        left = deadline_at - time.time()
        given, kept = client.turn(task_id)
        out.append((left, given, kept))
    return out


def test_a_turn_leaves_its_class_the_time_it_needs_after_the_turn(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    key = add_key(data_dir, "alice")
    auth = {"Authorization": f"Bearer {key}"}
    with appliance_process(data_dir, workers=1) as up:
        client = Client(up.url, auth)
        # No history yet: the turn may use the whole deadline.
        client.task("early", task_class="build", deadline_s=60)
        given, kept = client.turn("early")
        assert kept == 0.0 and 58.0 < given <= 60.0
        for n in range(3):
            _run_class_task(client, f"h{n}")
        first, second, third = _shares(client, "b")
        # After turn 1: two more turns, each with TOOLS_S before it, then CLOSE_S.
        assert 2 * TOOLS_S + CLOSE_S <= first[2] < 2 * TOOLS_S + CLOSE_S + 3.0, first
        assert TOOLS_S + CLOSE_S <= second[2] < first[2], second
        assert CLOSE_S <= third[2] < second[2], third
        for left, given, kept in (first, second, third):
            assert given + kept == pytest.approx(left, abs=1.0)  # the whole deadline, split
        # A task of no class keeps nothing: the turn has the whole deadline, as before.
        given, kept = client.turn("plain", **{"X-Deadline-S": "60"})
        assert kept == 0.0 and 58.0 < given <= 60.0
        # A turn without a deadline has no share to tell.
        assert "X-Appliance-Turn-Timeout-S" not in client.answer("free").headers
    # Restarted, the appliance starts from the ledger's history of the class.
    with appliance_process(data_dir, workers=1) as again:
        client = Client(again.url, auth)
        left, given, kept = _shares(client, "after")[0]
        assert 2 * TOOLS_S + CLOSE_S <= kept < 2 * TOOLS_S + CLOSE_S + 3.0
        assert given + kept == pytest.approx(left, abs=1.0)
