"""What the router measures of its own turns, built before the wiring: the cost model, the
worker speeds, the queue book and the GPU meter (the simulated GPU probe reads the meter, and
the probe is built before the wiring)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from appliance.config.settings import EngineKind, Settings
from appliance.perf.latency import LatencyModel
from appliance.perf.profile import GpuProfile
from appliance.ports import Clock
from appliance.services.turns.attempt_spans import AttemptSpans
from appliance.services.turns.queue_book import QueueBook
from appliance.services.workers.gpu_meter import GpuMeter
from appliance.services.workers.worker_speed import WorkerSpeeds
from appliance.start.served_kv import served_kv_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TurnMeasures:
    cost: LatencyModel
    speeds: WorkerSpeeds
    queues: QueueBook
    meter: GpuMeter


def turn_measures(settings: Settings, profile: GpuProfile, clock: Clock) -> TurnMeasures:
    """The worker speeds and the queue book over one record of the router's own attempts
    (the book writes it, the speeds take a sample only where it shows one request at a
    time), and the GPU meter over the queue book's slowdown."""
    cost = LatencyModel.from_profile(profile)
    spans = AttemptSpans(clock)
    speeds = WorkerSpeeds(cost, spans)
    queues = QueueBook(cost, clock, speeds.slowdown, spans)
    meter = GpuMeter(clock, cost, queues.slowdown, settings.engine.gpus_per_worker)
    return TurnMeasures(cost, speeds, queues, meter)


def served_measures(
    settings: Settings, kind: EngineKind, profile: GpuProfile, clock: Clock
) -> tuple[GpuProfile, TurnMeasures]:
    """The GPU profile at the served model's KV bytes per token, and the router's measures
    over it (the daemon's simulated GPU probe reads their GPU meter)."""
    kv = served_kv_bytes(settings.engine, kind, profile)
    log.info("KV bytes per token: %d (%s)", kv.bytes_per_token, kv.how)
    served_profile = profile.for_kv_bytes(kv.bytes_per_token)
    return served_profile, turn_measures(settings, served_profile, clock)
