"""The appliance wired without running: the composition root builds the API and every
service around workers of the test's own (a real ledger file, the real KV-index feed), and
the API answers from them over ASGI."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import pytest
from starlette.testclient import TestClient

from appliance import __version__
from appliance.api.admin.schemas import decode_state
from appliance.api.auth import Caller
from appliance.config.settings import Settings
from appliance.domain.gpu import GpuReading
from appliance.domain.records import TenantId, WorkerId
from appliance.domain.worker import WorkerState, power_state
from appliance.engines.clients.vllm_client import VllmClient
from appliance.engines.clients.workers import KvIndexFeed, WorkerHandle
from appliance.gpu.fake import FakeProbe
from appliance.ledger import LedgerWriter
from appliance.perf.profile import bundled_profile
from appliance.start.wiring import StartedEngines, wire
from tests.fakes import ManualClock


def handles(*states: WorkerState) -> list[WorkerHandle]:
    return [
        WorkerHandle(
            WorkerId(f"w{i}"),
            "external",
            f"http://127.0.0.1:{9 + i}",
            VllmClient(f"http://127.0.0.1:{9 + i}"),
            state=state,
        )
        for i, state in enumerate(states)
    ]


@contextmanager
def wired_app(tmp_path: Path, workers: list[WorkerHandle]) -> Iterator[TestClient]:
    ledger = LedgerWriter.open(tmp_path / "ledger.db")
    try:
        wired = wire(
            Settings(data_dir=tmp_path),
            engines=StartedEngines(lambda: workers, "m", 4096, "test:m"),
            ledger=ledger,
            feed=KvIndexFeed(),
            clock=ManualClock(),
            probe=FakeProbe([[GpuReading(0, "g", "u", 10, 4, 6, 0.5, 40.0, 100.0)]]),
            profile=bundled_profile(),
            keys={"ops": Caller(TenantId("ops"), True), "a": Caller(TenantId("a"), False)},
            secret=b"s" * 32,
        )
        with TestClient(wired.app) as http:
            yield http
    finally:
        ledger.close()


def test_the_wired_appliance_answers_without_running_anything(tmp_path: Path) -> None:
    with wired_app(tmp_path, handles(WorkerState.HEALTHY, WorkerState.UNHEALTHY)) as http:
        assert http.get("/health").json() == {"status": "ok", "version": __version__}
        served = http.get("/admin/v1/state", headers={"Authorization": "Bearer ops"})
        state = served.json()
        # The published document is the schema's: the console decodes it whole.
        assert msgspec.to_builtins(decode_state(served.content)) == state
        assert [(w["id"], w["healthy"]) for w in state["workers"]] == [
            ("w0", True),
            ("w1", False),
        ]
        assert [w["state"] for w in state["workers"]] == ["awake", "awake"]
        assert state["gpus"][0]["mem_used_bytes"] == 4
        models = http.get("/v1/models", headers={"Authorization": "Bearer a"}).json()
        assert models["data"][0]["max_model_len"] == 4096
        metrics = http.get("/metrics").text
        assert "appliance_workers_healthy 1.0" in metrics
        assert 'appliance_worker_state{state="awake",worker="w1"} 1.0' in metrics


@pytest.mark.parametrize(
    ("states", "ok"),
    [
        ((WorkerState.ASLEEP, WorkerState.STOPPED), True),
        ((WorkerState.WAKING, WorkerState.FAILED), True),
        ((WorkerState.EXITED, WorkerState.FAILED), False),
        ((WorkerState.STARTING, WorkerState.UNHEALTHY), False),
    ],
)
def test_health_is_ok_while_the_workers_rest_and_can_be_woken(
    tmp_path: Path, states: tuple[WorkerState, ...], ok: bool
) -> None:
    workers = handles(*states)
    with wired_app(tmp_path, workers) as http:
        answer = http.get("/health")
        assert answer.status_code == (200 if ok else 503)
        assert answer.json()["status"] == ("ok" if ok else "no healthy worker")
        state = http.get("/admin/v1/state", headers={"Authorization": "Bearer ops"}).json()
        # A failed worker is `stopped` as one at rest is; its lifecycle tells them apart.
        assert [(w["state"], w["lifecycle"]) for w in state["workers"]] == [
            (power_state(s).value, s.value) for s in states
        ]
        for w in workers:  # at shutdown they drain: a stopped worker then is no rest
            w.draining = True
        assert http.get("/health").status_code == 503
