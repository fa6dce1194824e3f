"""The appliance wired: engines, ledger and probes in, the API app and the services that
run behind it out. Part of the composition root (with bootstrap.py and daemon.py); it starts
nothing and runs nothing, so a test can build the whole house around workers of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial

from appliance.api.admin.admin_sessions import SessionAdmin
from appliance.api.app import ApiApp, create_api_app
from appliance.api.auth import LOCAL, Caller, Keys
from appliance.api.context import ApiContext
from appliance.api.turns.requests import Tokenizer
from appliance.api.turns.turn_prompts import ApiTurnTokenizer
from appliance.config.settings import Settings
from appliance.domain.block_hash import BlockHasher, HashAlgo
from appliance.domain.records import TaskId
from appliance.domain.worker import can_serve
from appliance.engines.clients.workers import KvIndexFeed, WorkerHandle
from appliance.ledger import LedgerWriter
from appliance.ledger.reports import cost_report
from appliance.ledger.restore import open_tasks, receipt_generations, recent_sessions
from appliance.ledger.task_history import TaskHistory
from appliance.oplog import LoggedEventFeed, log_turns
from appliance.perf.latency import CopyDirection, LatencyModel
from appliance.perf.profile import GpuProfile
from appliance.policy.admission import AdmissionLimits
from appliance.policy.routing.core import default_profile
from appliance.policy.worker_power import (
    CPU_VLLM_STATES,
    PowerSettings,
    PowerState,
    power_table,
)
from appliance.ports import Clock, GpuProbe, KvRetention, WorkerPowerSwitch
from appliance.services.operator.cost_series import CostSeries
from appliance.services.operator.events import EventFeed
from appliance.services.operator.state import StateSources, metrics_text, snapshot
from appliance.services.residency.no_retention import NoRetention
from appliance.services.residency.reaper_loop import ReaperLoop
from appliance.services.residency.residency_inputs import LiveInputs
from appliance.services.residency.tool_events import reaper_hears, restore_on_lead
from appliance.services.sessions.sessions import SessionTable
from appliance.services.sessions.tenancy import TenantSalts
from appliance.services.tasks.admission import AdmissionService, WorkerEstimator
from appliance.services.tasks.task_paces import TaskPaces
from appliance.services.tasks.task_state import TaskState
from appliance.services.tasks.tasks import TaskBook
from appliance.services.turns.desk_aides import TurnDeskAides
from appliance.services.turns.placement import Placer, RoutingRule
from appliance.services.turns.queue_book import QueueBook
from appliance.services.turns.turn_desk import TurnDesk
from appliance.services.turns.turn_records import TurnRecords
from appliance.services.workers.box_usage import BoxUsage, EnergyMeter, GpuTick
from appliance.services.workers.gpu_meter import GpuMeter
from appliance.services.workers.worker_reaper import PowerInputs, WorkerReaperLoop
from appliance.services.workers.worker_speed import WorkerSpeeds
from appliance.start.class_paces import finished_runs
from appliance.start.wiring_escalation import outside_escalation
from appliance.start.wiring_measures import TurnMeasures, turn_measures
from appliance.start.wiring_residency import live_residency_policy, sessions_kv
from appliance.tokenization.tokenizer import load_tokenizer

RESTORE_WINDOW_S = 24 * 3600.0
RESTORE_MAX = 10_000
"""A restart takes back the open tasks and the sessions active in the last day, the newest
10,000 of each (appliance/ledger/restore.py)."""


@dataclass
class StartedEngines:
    """What the wiring needs of the started engines."""

    workers: Callable[[], Sequence[WorkerHandle]]
    served_name: str
    max_model_len: int
    runtime_identity: str
    retention: KvRetention | None = None
    """The workers' retention channels; None: they have none (`no_retention`)."""
    no_retention: str = "the workers have no retention channel"
    """Why there is none, when there is none."""
    power: WorkerPowerSwitch | None = None
    """Sleep, stop and wake of the workers (None: the appliance did not start them)."""
    power_states: frozenset[PowerState] = CPU_VLLM_STATES
    """The states the workers can be put to (sleep mode: all)."""
    wake_s: tuple[float, float, float] | None = None
    """Seconds the workers take to wake from asleep-1, asleep-2 and stopped, when not the
    GPU profile's (simulated workers: stretched by their time scale)."""


@dataclass
class Wiring:
    app: ApiApp
    desk: TurnDesk
    speeds: WorkerSpeeds
    events: EventFeed
    gpu: GpuTick
    reaper: ReaperLoop | None
    """The idle reaper's loop (None: `residency.reaper` is off); the daemon runs it."""
    worker_reaper: WorkerReaperLoop | None
    """The worker reaper (None: `worker_reaper.worker_idle_s` unset, or no power switch)."""
    admission: AdmissionService
    """Its `limits` are replaced on a reload (`admission_limits`)."""
    usage: BoxUsage
    """The box's usage periods (the daemon runs it)."""


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
    events: EventFeed | None = None,
    measures: TurnMeasures | None = None,
) -> Wiring:
    """`events` and `measures`: built here unless built first (the daemon's workers report
    power events from their start, and its simulated GPU probe reads the GPU meter)."""
    events = events if events is not None else LoggedEventFeed()
    gpu = GpuTick(probe, EnergyMeter(engines.workers))
    m = measures if measures is not None else turn_measures(settings, profile, clock)
    cost, speeds, queues, meter = m.cost, m.speeds, m.queues, m.meter
    task_states: dict[TaskId, TaskState] = {}  # the task book's; the idle reaper reads them
    reaper = _reaper_loop(settings, engines, ledger, feed, clock, queues, task_states, profile)
    sessions, tasks, paces = _books(settings, ledger, events, reaper, task_states, clock, feed)
    worker_reaper = _worker_reaper(settings, engines, ledger, clock, meter, reaper, profile)
    prompts = ApiTurnTokenizer(load_tokenizer(settings.engine.model), engines.max_model_len)
    aides = TurnDeskAides(worker_reaper=worker_reaper, paces=paces, tokenizer=prompts)
    parts = (cost, queues, meter)
    desk, admission = _turn_desk(
        settings, engines, ledger, feed, clock, parts, (sessions, tasks, events), aides, secret
    )
    admin, kv = sessions_kv(
        desk, ledger, events, profile.kv_bytes_per_token, reaper, settings.ledger_path
    )
    usage = BoxUsage(meter, gpu.energy, ledger, clock, settings.ledger.usage_period_s)
    sources = StateSources(
        workers=lambda: [w.status() for w in engines.workers()],
        desk=desk,
        tasks=tasks,
        gpus=lambda: gpu.reading,
        clock_now=clock.now,
        kv_bytes_per_token=profile.kv_bytes_per_token,
        currency=settings.costs.currency,
        events=events,
        kv=kv,
        cost_series=CostSeries(),
        admission=admission,
        wakes=worker_reaper.wake_seconds if worker_reaper is not None else None,
        kv_tokens=lambda w: feed.gpu_blocks(w) * settings.engine.block_size,
        usage=usage,
    )
    api = (desk, tasks, admission, admin)
    app = _api_app(settings, engines, api, sources, keys, clock, ledger, prompts.tokenizer)
    return Wiring(app, desk, speeds, events, gpu, reaper, worker_reaper, admission, usage)


def _api_app(
    settings: Settings,
    engines: StartedEngines,
    services: tuple[TurnDesk, TaskBook, AdmissionService, SessionAdmin],
    sources: StateSources,
    keys: Mapping[str, Caller] | Callable[[], Mapping[str, Caller]],
    clock: Clock,
    ledger: LedgerWriter,
    tokenizer: Tokenizer,
) -> ApiApp:
    """The HTTP API over the services; the state and /metrics read `sources`."""
    desk, tasks, admission, admin = services
    return create_api_app(
        ApiContext(
            desk=desk,
            tasks=tasks,
            tokenizer=tokenizer,
            keys=Keys(keys, anyone=LOCAL if settings.server.auth == "none" else None),
            clock=clock,
            model=engines.served_name,
            model_aliases=settings.api.model_aliases,
            max_model_len=engines.max_model_len,
            state=lambda: snapshot(sources),
            healthy=lambda: any(can_serve(w.state, w.draining) for w in engines.workers()),
            ledger_failing=lambda: ledger.failing,
            metrics=lambda: metrics_text(sources),
            costs=lambda: cost_report(settings.ledger_path),
            admission=admission,
            workers=engines.workers,
            sessions_admin=admin,
        )
    )


def _reaper_loop(
    settings: Settings,
    engines: StartedEngines,
    ledger: LedgerWriter,
    feed: KvIndexFeed,
    clock: Clock,
    queues: QueueBook,
    tasks: Mapping[TaskId, TaskState],
    profile: GpuProfile,
) -> ReaperLoop | None:
    """The idle reaper on live inputs, running the policy `residency.policy` names (a wait
    model warmed with the waits between the ledger's recent turns: RESTORE_WINDOW_S,
    RESTORE_MAX); `tasks`: the task book's tasks, as it keeps them."""
    r = settings.residency
    if not r.reaper:
        return None
    now = clock.now()
    policy = live_residency_policy(
        r,
        kv_bytes_per_token=profile.kv_bytes_per_token,
        ledger_path=settings.ledger_path,
        window=(now - RESTORE_WINDOW_S, now),
        limit=RESTORE_MAX,
    )
    inputs = LiveInputs(
        index=feed,
        workers=engines.workers,
        prefill_s=lambda worker, n: queues.prefill_s(worker, n, 0),
        task_closed=lambda key: (t := tasks.get(key)) is not None and t.status.ends_sessions,
        kv_bytes_per_token=profile.kv_bytes_per_token,
        model=engines.served_name,
        runtime_identity=engines.runtime_identity,
        copy_in_s=partial(
            LatencyModel.from_profile(profile).kv_copy_s, direction=CopyDirection.H2D
        ),
        task_parent=lambda key: t.parent if (t := tasks.get(key)) is not None else None,
    )
    retention = engines.retention
    if retention is None:
        note = f"{engines.no_retention}: decisions are recorded, none is sent"
        retention = NoRetention(note)
    else:
        note = "holds are sent to the workers' retention connectors"
    lead_time = partial(
        restore_on_lead, inputs=inputs, ledger=ledger, restore_ahead=r.restore_ahead
    )
    return ReaperLoop(
        policy, retention, inputs, ledger=ledger, clock=clock, note=note, lead_time=lead_time
    )


def _worker_reaper(
    settings: Settings,
    engines: StartedEngines,
    ledger: LedgerWriter,
    clock: Clock,
    meter: GpuMeter,
    reaper: ReaperLoop | None,
    profile: GpuProfile,
) -> WorkerReaperLoop | None:
    """Idle workers sleep or stop, and a turn wakes one (`worker_reaper.worker_idle_s` set, and
    workers the appliance started)."""
    r = settings.worker_reaper
    if r.worker_idle_s is None or engines.power is None:
        return None
    wake = profile.wake
    assert wake is not None  # parse_profile fills it in
    seconds = engines.wake_s or (wake.asleep_1.seconds, wake.asleep_2.seconds, wake.stopped.seconds)
    kv = settings.engine.kv_cache_memory_bytes or 0
    table = power_table(seconds, wake.weights_bytes, kv, engines.power_states)
    inputs = PowerInputs(
        workers=lambda: [w.status() for w in engines.workers()],
        in_flight=meter.in_flight,
        model=engines.served_name,
        table=table,
        settings=PowerSettings(r.worker_idle_s, r.max_wake_s or math.inf, r.min_awake),
        gpus_per_worker=settings.engine.gpus_per_worker,
    )
    rests = reaper.worker_rests if reaper is not None else None
    return WorkerReaperLoop(
        engines.power, inputs, ledger=ledger, clock=clock, meter=meter, before_rest=rests
    )


def admission_limits(settings: Settings) -> AdmissionLimits:
    """The admission policy's limits: every `admission.*` key but `task_idle_s`, which the
    task book reads once."""
    return AdmissionLimits(**settings.admission.model_dump(exclude={"task_idle_s"}))


def _placer(
    settings: Settings,
    engines: StartedEngines,
    feed: KvIndexFeed,
    sessions: SessionTable,
    queues: QueueBook,
    cost: LatencyModel,
    secret: bytes,
) -> Placer:
    return Placer(
        workers=engines.workers,
        index=feed,
        sessions=sessions,
        queues=queues,
        rule=RoutingRule(
            default_profile(**settings.routing.model_dump()), cost, engines.served_name
        ),
        salt=TenantSalts(secret),
        retention=engines.retention,
    )


def _books(
    settings: Settings,
    ledger: LedgerWriter,
    events: EventFeed,
    reaper: ReaperLoop | None,
    task_states: dict[TaskId, TaskState],
    clock: Clock,
    feed: KvIndexFeed,
) -> tuple[SessionTable, TaskBook, TaskPaces]:
    """The session table (the idle reaper hears its turns begin and end), and the task book
    (a task's close teaches the paces and ends its sessions; the reaper hears its tools),
    with what a restart takes back from the ledger (RESTORE_WINDOW_S, RESTORE_MAX): open
    tasks, recent sessions, the paces of finished tasks, and the workers' cache generations
    the new KV index continues after."""
    e = settings.engine
    hasher = BlockHasher.for_engine(HashAlgo(e.hash_algo), e.block_size, e.python_hash_seed)
    sessions = SessionTable(hasher, subscribers=(reaper,) if reaper is not None else ())
    paces = TaskPaces(clock)  # each turn's share of its task's deadline
    tasks = TaskBook(
        ledger,
        events,
        idle_s=settings.admission.task_idle_s,
        archive=TaskHistory(settings.ledger_path),
        states=task_states,
        on_close=paces.hearing(sessions.forget_task),  # learns, ends its sessions
        on_tool_event=reaper_hears(reaper) if reaper is not None else None,
    )
    path, since = settings.ledger_path, clock.now() - RESTORE_WINDOW_S
    tasks.restore(open_tasks(path, since=since, limit=RESTORE_MAX))
    sessions.restore(recent_sessions(path, since=since, limit=RESTORE_MAX))
    feed.start_generations(receipt_generations(path))
    paces.warm(finished_runs(path, since=since))
    return sessions, tasks, paces


def _turn_desk(
    settings: Settings,
    engines: StartedEngines,
    ledger: LedgerWriter,
    feed: KvIndexFeed,
    clock: Clock,
    parts: tuple[LatencyModel, QueueBook, GpuMeter],
    books: tuple[SessionTable, TaskBook, EventFeed],
    aides: TurnDeskAides,
    secret: bytes,
) -> tuple[TurnDesk, AdmissionService]:
    """The turn desk over the books, with its records, placer, admission and escalation;
    `aides`: what is built already of what it consults (the worker reaper, the paces)."""
    cost, queues, meter = parts
    sessions, tasks, events = books
    records = TurnRecords(
        ledger,
        model=engines.served_name,
        runtime_identity=engines.runtime_identity,
        on_turn=log_turns(tasks.add_turn),
        meter=meter,
    )
    placer = _placer(settings, engines, feed, sessions, queues, cost, secret)
    rests = aides.worker_reaper
    admission = AdmissionService(
        limits=admission_limits(settings),
        tasks=tasks,
        estimator=WorkerEstimator(  # queue_s: the queued prefill ahead of new work
            engines.workers,
            queues.queue_s,
            cost,
            queues.slowdown,
            wake_s=rests.wake_s if rests is not None else lambda w: None,
        ),
        ledger=ledger,
        clock=clock,
        events=events,
    )
    escalation = outside_escalation(settings.escalation, records, clock)
    desk = TurnDesk(
        sessions=sessions,
        placer=placer,
        queues=queues,
        records=records,
        tasks=tasks,
        clock=clock,
        workers=engines.workers,
        aides=replace(aides, admission=admission, escalation=escalation),
    )
    return desk, admission
