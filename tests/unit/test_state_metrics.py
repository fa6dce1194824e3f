"""The appliance's own `/metrics`: each worker's power state as a gauge per state, 1 for the
one it is in and 0 for the others, so that a query needs no list of states."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from appliance.domain.records import WorkerId
from appliance.domain.worker import WorkerPowerState, WorkerState, WorkerStatus
from appliance.services.operator.histogram import PromHistogram
from appliance.services.operator.state import StateSources, metrics_text
from appliance.services.tasks.tasks import TaskBook
from appliance.services.turns.turn_records import TurnRecords
from appliance.services.workers.gpu_meter import GpuTime
from tests.fakes import AckLedger


def scrape(
    *states: WorkerState, wakes: PromHistogram | None = None
) -> dict[str, dict[tuple[str, str], float]]:
    workers = [
        WorkerStatus(WorkerId(f"w{i}"), "vllm", "http://x", (), state, False, 0)
        for i, state in enumerate(states)
    ]
    desk = SimpleNamespace(
        sessions=[],
        records=TurnRecords(AckLedger(), model="m"),  # type: ignore[arg-type]
        queues=SimpleNamespace(slowdown=lambda w: 1.0),
    )
    src = StateSources(
        workers=lambda: workers,
        desk=desk,  # type: ignore[arg-type]
        tasks=TaskBook(AckLedger()),  # type: ignore[arg-type]
        gpus=lambda: None,
        clock_now=lambda: 0.0,
        kv_bytes_per_token=1,
        currency="USD",
        wakes=wakes,
    )
    out: dict[str, dict[tuple[str, str], float]] = {}
    for family in text_string_to_metric_families(metrics_text(src)):
        for sample in family.samples:
            key = (
                sample.labels.get("worker", ""),
                sample.labels.get("state", "") or sample.labels.get("le", ""),
            )
            out.setdefault(sample.name, {})[key] = sample.value
    return out


def test_each_worker_is_in_exactly_its_power_state() -> None:
    states = (WorkerState.HEALTHY, WorkerState.ASLEEP, WorkerState.STOPPED, WorkerState.WAKING)
    gauge = scrape(*states)["appliance_worker_state"]
    assert len(gauge) == 4 * len(WorkerPowerState)
    now = {worker: state for (worker, state), v in gauge.items() if v == 1.0}
    assert now == {"w0": "awake", "w1": "asleep", "w2": "stopped", "w3": "waking"}
    assert sorted(v for v in gauge.values()) == [0.0] * 12 + [1.0] * 4
    assert scrape(*states)["appliance_workers_healthy"] == {("", ""): 1.0}


def test_a_crashed_worker_shows_as_stopped_and_starting_as_waking() -> None:
    gauge = scrape(WorkerState.EXITED, WorkerState.STARTING)["appliance_worker_state"]
    assert {w for (w, s), v in gauge.items() if v == 1.0 and s == "stopped"} == {"w0"}
    assert {w for (w, s), v in gauge.items() if v == 1.0 and s == "waking"} == {"w1"}


def test_the_worker_reapers_wakes_are_a_histogram_when_it_runs() -> None:
    assert "appliance_worker_wake_seconds_count" not in scrape(WorkerState.HEALTHY)
    wakes = PromHistogram((5, 30))
    for seconds in (2.7, 22.9, 41.0):
        wakes.observe(seconds)
    got = scrape(WorkerState.HEALTHY, wakes=wakes)
    assert got["appliance_worker_wake_seconds_count"] == {("", ""): 3.0}
    buckets = got["appliance_worker_wake_seconds_bucket"]
    assert (buckets[("", "5")], buckets[("", "30")], buckets[("", "+Inf")]) == (1, 2, 3)
    assert got["appliance_worker_wake_seconds_sum"][("", "")] == 2.7 + 22.9 + 41.0


def test_each_workers_gpu_seconds_and_energy_are_counters() -> None:
    status = WorkerStatus(WorkerId("w0"), "sim", "http://x", (), WorkerState.HEALTHY, False, 0)
    workers = [status, dataclasses.replace(status, id=WorkerId("w1"))]
    records = TurnRecords(AckLedger(), model="m")  # type: ignore[arg-type]
    records.meter = SimpleNamespace(reading=lambda w: GpuTime(awake_s=100.0, busy_s=30.0))  # type: ignore[assignment]
    queues = SimpleNamespace(slowdown=lambda w: 1.0)
    desk = SimpleNamespace(sessions=[], records=records, queues=queues)
    joules = {WorkerId("w0"): 3600.0}  # w1: no power reading yet
    src = StateSources(
        workers=lambda: workers,
        desk=desk,  # type: ignore[arg-type]
        tasks=TaskBook(AckLedger()),  # type: ignore[arg-type]
        gpus=lambda: None,
        clock_now=lambda: 0.0,
        kv_bytes_per_token=1,
        currency="USD",
        usage=SimpleNamespace(energy=SimpleNamespace(joules=joules.get)),  # type: ignore[arg-type]
    )
    samples = {
        (s.name, s.labels.get("worker")): s.value
        for family in text_string_to_metric_families(metrics_text(src))
        for s in family.samples
    }
    assert samples[("appliance_worker_gpu_busy_seconds_total", "w1")] == 30.0
    assert samples[("appliance_worker_gpu_idle_seconds_total", "w1")] == 70.0
    assert samples[("appliance_worker_gpu_energy_joules_total", "w0")] == 3600.0
    assert ("appliance_worker_gpu_energy_joules_total", "w1") not in samples
