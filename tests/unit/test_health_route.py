"""`/health` answers from the workers' health and whether the ledger can write, in constant
time: it never builds the state document (whose size grows with sessions and tasks)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from starlette.testclient import TestClient

from appliance import __version__
from appliance.api.app import create_api_app
from appliance.api.auth import Keys
from appliance.api.context import ApiContext


def never() -> Any:
    raise AssertionError("/health built the whole state")


@pytest.mark.parametrize(
    ("healthy", "failing", "status", "says"),
    [
        (True, None, 200, {"status": "ok"}),
        (False, None, 503, {"status": "no healthy worker"}),
        (True, "disk full", 503, {"status": "degraded", "ledger": "disk full"}),
    ],
)
def test_health_reads_only_the_workers_and_the_ledger(
    healthy: bool, failing: str | None, status: int, says: dict[str, str]
) -> None:
    ctx = ApiContext(
        desk=SimpleNamespace(),  # type: ignore[arg-type]
        tasks=SimpleNamespace(),  # type: ignore[arg-type]
        tokenizer=SimpleNamespace(),  # type: ignore[arg-type]
        keys=Keys({}),
        clock=SimpleNamespace(now=lambda: 0.0),  # type: ignore[arg-type]
        model="m",
        max_model_len=16,
        state=never,
        healthy=lambda: healthy,
        ledger_failing=lambda: failing,
        metrics=lambda: "",
        costs=lambda: [],
    )
    with TestClient(create_api_app(ctx)) as http:
        answer = http.get("/health")
    assert (answer.status_code, answer.json()) == (status, {**says, "version": __version__})
