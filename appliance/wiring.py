"""The appliance wired: engines, ledger and probes in, the API app and the services that
run behind it out. Part of the composition root (with bootstrap.py and daemon.py); it starts
nothing and runs nothing, so a test can build the whole house around workers of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from appliance.api.admin_sessions import SessionAdmin
from appliance.api.app import ApiApp, create_api_app
from appliance.api.auth import Caller, Keys
from appliance.api.context import ApiContext
from appliance.domain.block_hash import BlockHasher, HashAlgo
from appliance.domain.gpu import GpuSnapshot
from appliance.engines.workers import KvIndexFeed, WorkerHandle
from appliance.ledger import LedgerWriter
from appliance.ledger.reports import cost_report
from appliance.ledger.restore import open_tasks, recent_sessions
from appliance.ledger.session_history import session_turns
from appliance.perf.latency import LatencyModel
from appliance.perf.profile import GpuProfile
from appliance.policy.admission import AdmissionLimits
from appliance.policy.routing.core import default_profile
from appliance.ports import Clock, GpuProbe
from appliance.services.admission import AdmissionService, WorkerEstimator
from appliance.services.attempt_spans import AttemptSpans
from appliance.services.cost_series import CostSeries
from appliance.services.events import EventFeed
from appliance.services.placement import Placer
from appliance.services.queue_book import QueueBook
from appliance.services.session_admin import SessionReleases
from appliance.services.sessions import SessionTable
from appliance.services.state import StateSources, metrics_text, snapshot
from appliance.services.tasks import TaskBook
from appliance.services.tenancy import TenantSalts
from appliance.services.turn_desk import TurnDesk
from appliance.services.turn_records import TurnRecords
from appliance.services.worker_speed import WorkerSpeeds
from appliance.settings import Settings
from appliance.tokenization.tokenizer import load_tokenizer

RESTORE_WINDOW_S = 24 * 3600.0
RESTORE_MAX = 10_000
"""A restart takes back the open tasks and the sessions active in the last day, the newest
10,000 of each (appliance/ledger/restore.py)."""


class GpuTick:
    """The GPU probe's latest reading, taken by the refresh loop, read by the state."""

    def __init__(self, probe: GpuProbe) -> None:
        self.probe = probe
        self.reading: GpuSnapshot = probe.snapshot()


@dataclass
class StartedEngines:
    """What the wiring needs of the started engines."""

    workers: Callable[[], Sequence[WorkerHandle]]
    served_name: str
    max_model_len: int
    runtime_identity: str


@dataclass
class Wiring:
    app: ApiApp
    desk: TurnDesk
    speeds: WorkerSpeeds
    events: EventFeed
    gpu: GpuTick


def wire(
    settings: Settings,
    *,
    engines: StartedEngines,
    ledger: LedgerWriter,
    feed: KvIndexFeed,
    clock: Clock,
    probe: GpuProbe,
    profile: GpuProfile,
    keys: Mapping[str, Caller] | Callable[[], Mapping[str, Caller]],
    secret: bytes,
) -> Wiring:
    events = EventFeed()
    gpu = GpuTick(probe)
    workers = engines.workers
    cost = LatencyModel.from_profile(profile)
    speeds, queues = _measured_queues(cost, clock)
    desk, admission, sessions, tasks = _turn_desk(
        settings, engines, ledger, feed, clock, cost, queues, events, secret
    )
    _restore(settings.ledger_path, clock.now(), tasks, sessions)
    releases = SessionReleases(sessions, ledger, events, profile.kv_bytes_per_token)
    sources = StateSources(
        workers=lambda: [w.status() for w in workers()],
        desk=desk,
        tasks=tasks,
        gpus=lambda: gpu.reading,
        clock_now=clock.now,
        kv_bytes_per_token=profile.kv_bytes_per_token,
        currency=settings.costs.currency,
        events=events,
        releases=releases,
        cost_series=CostSeries(),
        admission=admission,
    )
    ledger_path = Path(settings.ledger_path)
    app = create_api_app(
        ApiContext(
            desk=desk,
            tasks=tasks,
            tokenizer=load_tokenizer(settings.engine.model),
            keys=Keys(keys),
            clock=clock,
            model=engines.served_name,
            max_model_len=engines.max_model_len,
            state=lambda: snapshot(sources),
            healthy=lambda: any(w.healthy for w in workers()),
            ledger_failing=lambda: ledger.failing,
            metrics=lambda: metrics_text(sources),
            costs=lambda: cost_report(ledger_path),
            admission=admission,
            sessions_admin=SessionAdmin(
                releases,
                lambda tenant, sid, limit: session_turns(ledger_path, tenant, sid, limit=limit),
                desk.placer.residency,
            ),
        )
    )
    return Wiring(app, desk, speeds, events, gpu)


def _measured_queues(cost: LatencyModel, clock: Clock) -> tuple[WorkerSpeeds, QueueBook]:
    """The worker speeds and the queue book over one record of the router's own attempts:
    the book writes it, the speeds take a sample only where it shows one request at a time."""
    spans = AttemptSpans(clock)
    speeds = WorkerSpeeds(cost, spans)
    return speeds, QueueBook(cost, clock, speeds.slowdown, spans)


def _restore(ledger_path: Path, now: float, tasks: TaskBook, sessions: SessionTable) -> None:
    """What a restart takes back from the ledger (RESTORE_WINDOW_S, RESTORE_MAX)."""
    since = now - RESTORE_WINDOW_S
    tasks.restore(open_tasks(ledger_path, since=since, limit=RESTORE_MAX))
    sessions.restore(recent_sessions(ledger_path, since=since, limit=RESTORE_MAX))


def _turn_desk(
    settings: Settings,
    engines: StartedEngines,
    ledger: LedgerWriter,
    feed: KvIndexFeed,
    clock: Clock,
    cost: LatencyModel,
    queues: QueueBook,
    events: EventFeed,
    secret: bytes,
) -> tuple[TurnDesk, AdmissionService, SessionTable, TaskBook]:
    e = settings.engine
    hasher = BlockHasher.for_engine(HashAlgo(e.hash_algo), e.block_size, e.python_hash_seed)
    tasks = TaskBook(ledger, events, idle_s=settings.admission.task_idle_s)
    sessions = SessionTable(hasher)
    records = TurnRecords(
        ledger,
        model=engines.served_name,
        runtime_identity=engines.runtime_identity,
        on_turn=tasks.add_turn,
    )
    placer = Placer(
        workers=engines.workers,
        index=feed,
        sessions=sessions,
        queues=queues,
        cost=cost,
        profile=default_profile(**settings.routing.model_dump()),
        model=engines.served_name,
        salt=TenantSalts(secret),
    )
    admission = AdmissionService(
        limits=AdmissionLimits(**settings.admission.model_dump(exclude={"task_idle_s"})),
        tasks=tasks,
        # queue_s: the queued prefill ahead of new work
        estimator=WorkerEstimator(engines.workers, queues.queue_s, cost, queues.slowdown),
        ledger=ledger,
        clock=clock,
        events=events,
    )
    desk = TurnDesk(
        sessions=sessions,
        placer=placer,
        queues=queues,
        records=records,
        tasks=tasks,
        clock=clock,
        workers=engines.workers,
        admission=admission,
    )
    return desk, admission, sessions, tasks
