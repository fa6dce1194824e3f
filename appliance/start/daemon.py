"""`appliance up`: Settings -> engine workers -> index, ledger, router -> HTTP API, until a
signal; then drain and stop in reverse order. Part of the composition root (with
bootstrap.py, engine_start.py and wiring.py): it names the ledger, and
appliance/start/engine_start.py starts the engines (sim, vllm or external) and picks the GPU
probe that watches them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import secrets
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance import __version__
from appliance.api.http_server.server import ApiServer
from appliance.api.starting import starting_app
from appliance.api.turns.requests import MAX_BODY_BYTES
from appliance.config import keystore
from appliance.config.datadir import ensure_data_dir, lock_data_dir
from appliance.config.settings import EngineKind, Settings
from appliance.domain.records import CostMode, Price
from appliance.domain.worker import can_serve
from appliance.engines.clients.workers import KvIndexFeed
from appliance.engines.supervision.port_plan import planned_ports
from appliance.eventloop import new_event_loop
from appliance.ledger import LedgerWriter
from appliance.oplog import LoggedEventFeed, start_logging
from appliance.perf.profile import bundled_profile, load_profile
from appliance.ports import GpuProbe
from appliance.services.residency.reaper_runner import run_reaper
from appliance.services.workers.worker_watch import WorkerWatch, power_event_sink
from appliance.start.access import access_note, check_aliases, key_callers
from appliance.start.engine_start import (
    Engines,
    gpu_probe,
    resolve_kind,
    runtime_identity,
    start_engines,
)
from appliance.start.live_reload import LiveReload
from appliance.start.sdnotify import Notifier
from appliance.start.wiring import StartedEngines, Wiring, admission_limits, wire
from appliance.start.wiring_measures import served_measures

log = logging.getLogger(__name__)
REFRESH_S = 0.5


class WallClock:
    def now(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def _secret(data_dir: Path) -> bytes:
    path = data_dir / "secret.key"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return bytes.fromhex(path.read_text().strip())


@dataclass
class Control:
    """What reaches the running appliance from outside it: `ready` is set once the API
    serves (tests), `live` applies reloads (SIGHUP), `notifier` tells systemd."""

    ready: asyncio.Event | None = None
    live: LiveReload | None = None
    notifier: Notifier = field(default_factory=lambda: Notifier(None))


async def serve(settings: Settings, *, control: Control | None = None) -> None:
    """`appliance up` until cancelled: engines, the wired appliance, the API, the refresh
    loop and the idle reaper run under one task group; cancelling it drains the API, stops
    the workers and closes the ledger."""
    check_aliases(settings)
    settings = planned_ports(settings)  # PortInUse names every port in use at once
    data_dir = ensure_data_dir(settings.data_dir)
    with lock_data_dir(data_dir):
        await _serve(settings, data_dir, control or Control())


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


async def _serve(settings: Settings, data_dir: Path, control: Control) -> None:
    server = _api_server(starting_app, settings)
    await server.start()  # the port is ours from now: `starting` until the workers serve
    try:
        await _start(settings, data_dir, control, server)
    finally:
        await server.stop()  # stopped already when it served; else it was still starting


async def _start(settings: Settings, data_dir: Path, control: Control, server: ApiServer) -> None:
    log_dir = ensure_data_dir(settings.log_path)
    kind = resolve_kind(settings)
    keys_file = keystore.keys_path(data_dir)
    keystore.ensure_default_keys(keys_file)
    key_file = keystore.KeyFile(keys_file)
    ledger = _open_ledger(settings)
    gpu_profile = settings.engine.gpu_profile
    profile = load_profile(gpu_profile) if gpu_profile else bundled_profile()
    clock = WallClock()
    feed = KvIndexFeed()
    events = LoggedEventFeed()  # the workers' sleeps, stops and wakes go here from their start
    probe: GpuProbe | None = None
    try:
        async with start_engines(
            settings, kind, feed, log_dir, power_event_sink(events)
        ) as engines:
            served_profile, measures = served_measures(settings, kind, profile, clock)
            probe = gpu_probe(
                kind,
                profile,
                settings.engine.block_size,
                lambda: engines.workers,
                feed.gpu_blocks,
                measures.meter,
            )
            wired = wire(
                settings,
                engines=_engines_view(settings, kind, engines),
                ledger=ledger,
                feed=feed,
                clock=clock,
                probe=probe,
                profile=served_profile,
                keys=key_callers(key_file),
                secret=_secret(data_dir),
                events=events,
                measures=measures,
            )
            if control.live is not None:
                _reloads(control.live, key_file, ledger, wired)
            _log_plan(kind, engines, log_dir)
            url = f"http://{settings.server.host}:{settings.server.port}"
            print(
                f"appliance {__version__}: engine {kind.value} "
                f"({_plural(len(engines.workers), 'worker')}, model {engines.served_name}); "
                f"API at {url}; {access_note(settings, keys_file)}\n"
                f"appliance: {gpu_plan(kind, engines.workers)}",
                flush=True,
            )
            try:
                await _run_api(server, engines, wired, ledger, clock, control, url)
            finally:
                log.info("the API has drained; stopping the workers")
                await wired.desk.escalation.aclose()  # the outside endpoints' connections
    finally:
        if probe is not None:  # the workers had started
            log.info("workers stopped; closing the ledger")
            probe.close()
        ledger.close()


async def _run_api(
    server: ApiServer,
    engines: Engines,
    wired: Wiring,
    ledger: LedgerWriter,
    clock: WallClock,
    control: Control,
    url: str,
) -> None:
    """The API and the loops behind it, until the API stops (cancelled: after its drain).
    The wired app takes over from `starting` once the loops run and the workers' first
    readings (health, load, KV use) are in: no turn is decided on none."""
    refreshed = asyncio.Event()
    async with asyncio.TaskGroup() as group:
        loops = [group.create_task(_refresh(engines, wired, clock, ledger, refreshed))]
        loops.append(group.create_task(wired.usage.run()))  # its last period at the stop
        if wired.reaper is not None:
            loops.append(group.create_task(run_reaper(wired.reaper)))
        if wired.worker_reaper is not None:
            loops.append(group.create_task(wired.worker_reaper.run()))
        await refreshed.wait()
        server.app = wired.app
        serving = group.create_task(server.serve())
        await _started(server, serving, control.ready)
        loops.append(group.create_task(_ready(engines, ledger, control.notifier, url)))
        await serving
        for loop in loops:
            loop.cancel()


def _engines_view(settings: Settings, kind: EngineKind, engines: Engines) -> StartedEngines:
    return StartedEngines(
        lambda: engines.workers,
        engines.served_name,
        engines.max_model_len,
        runtime_identity(settings, kind),
        engines.retention,
        engines.no_retention,
        engines.power,
        engines.power_states,
        engines.wake_s,
    )


def gpu_plan(kind: EngineKind, workers: Sequence[Any]) -> str:
    """Which GPUs each worker was given, as `up` prints it at start."""
    given = [(w.id, w.gpus) for w in workers if w.gpus]
    if given:
        plan = "; ".join(f"{wid} -> {','.join(map(str, gpus))}" for wid, gpus in given)
        how = " (simulated: ids only)" if kind == EngineKind.SIM else ""
        return f"GPUs by worker{how}: {plan}"
    if kind == EngineKind.SIM:
        return "GPUs: none (simulated workers; --gpus gives them GPU ids)"
    if kind == EngineKind.EXTERNAL:
        return "GPUs: those of the external servers"
    return "GPUs: none (vLLM's CPU build)"


def _log_plan(kind: EngineKind, engines: Engines, log_dir: Path) -> None:
    for w in engines.workers:
        log.info(
            "plan: worker %s (%s) at %s, GPUs %s",
            w.id,
            kind.value,
            w.url,
            ",".join(map(str, w.gpus)) or "none",
        )
    log.info(
        "plan: model %s, max_model_len %d; worker logs in %s",
        engines.served_name,
        engines.max_model_len,
        log_dir,
    )


def _reloads(
    live: LiveReload, key_file: keystore.KeyFile, ledger: LedgerWriter, wired: Wiring
) -> None:
    """What a reload changes in the running appliance (appliance/start/live_reload.py)."""
    live.on_keys(key_file.refresh)
    live.on_change("log_level", _set_log_level)
    live.on_change("costs", lambda s: ledger.set_price(configured_price(s, time.time())))
    live.on_change("admission", lambda s: setattr(wired.admission, "limits", admission_limits(s)))


def _set_log_level(settings: Settings) -> None:
    logging.getLogger().setLevel(settings.log_level)
    log.debug("log level now %s", settings.log_level)


async def _ready(engines: Engines, ledger: LedgerWriter, notifier: Notifier, url: str) -> None:
    """Tells systemd the appliance is ready once the API serves (the caller waited for it)
    and every worker has come up (healthy, or already put to rest by the worker reaper:
    `can_serve`), with the ledger writing: what `/health` then says."""
    while ledger.failing is not None or not all(
        can_serve(w.state, w.draining) for w in engines.workers
    ):
        await asyncio.sleep(0.1)
    if notifier.ready(f"serving at {url} with {_plural(len(engines.workers), 'worker')}"):
        log.info("told systemd: ready")


def _api_server(app: Any, settings: Settings) -> ApiServer:
    s = settings.server
    return ApiServer(
        app,
        s.host,
        s.port,
        max_body=MAX_BODY_BYTES,
        grace_s=30,
        idle_s=s.idle_timeout_s,
        request_s=s.request_timeout_s,
    )


def _open_ledger(settings: Settings) -> LedgerWriter:
    """The ledger, with the configured price in effect from now."""
    ledger = LedgerWriter.open(
        settings.ledger_path,
        synchronous=settings.ledger.synchronous,
        batch_max=settings.ledger.batch_max,
        busy_timeout_s=settings.ledger.busy_timeout_s,
    )
    ledger.set_price(configured_price(settings, time.time())).result()
    return ledger


def configured_price(settings: Settings, effective_from: float) -> Price:
    c = settings.costs  # every `costs.*` key is the price's but the mode
    return Price(CostMode(c.mode), effective_from, **c.model_dump(exclude={"mode"}))


async def _started(
    server: ApiServer, serving: asyncio.Task[None], ready: asyncio.Event | None
) -> None:
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    # Everything built so far (modules, settings, the app) lives as long as the process:
    # moved out of the collector's sight, a full collection no longer walks it (tens of ms
    # on the event loop, a p99 of every request in flight).
    gc.collect()
    gc.freeze()
    if ready is not None:
        ready.set()


async def _refresh(
    engines: Engines,
    wired: Wiring,
    clock: WallClock,
    ledger: LedgerWriter,
    refreshed: asyncio.Event,
) -> None:
    """Twice a second: the workers' health and load, their measured speeds, restarts and
    outages into the event feed, one GPU reading, and while the ledger cannot write, a probe
    of whether it can again. `refreshed` is set after the first pass."""
    watch = WorkerWatch(
        wired.events,
        restarts=lambda w: w.restarts,  # type: ignore[attr-defined]
        resting=lambda w: w.resting,  # type: ignore[attr-defined]
    )
    while True:
        try:
            await engines.refresh()
            if ledger.failing is not None:  # is there room again? (clears `failing`)
                ledger.probe()
            watch.observe(engines.workers, clock.now())
            wired.speeds.observe(engines.workers)
            wired.gpu.take(await asyncio.to_thread(wired.gpu.probe.snapshot))  # and energy
        except Exception:
            log.exception("refreshing worker and GPU readings failed")
        refreshed.set()
        await asyncio.sleep(REFRESH_S)


def run_foreground(settings: Settings, reload: Callable[[], Settings] | None = None) -> None:
    """Foreground: until Ctrl-C or SIGTERM, then a clean stop; SIGHUP reloads (with `reload`,
    which reads the settings again from the sources they came from). The appliance's own log
    lines go to stderr and to appliance.log in the log dir at `log_level`."""
    stop_logging = start_logging(settings.log_level, ensure_data_dir(settings.log_path))
    try:
        _run(settings, reload)
    finally:
        stop_logging()


def _run(settings: Settings, reload: Callable[[], Settings] | None) -> None:
    notifier = Notifier.from_env()
    live = LiveReload(settings, reload or (lambda: settings), settings.data_dir.expanduser())
    loop = new_event_loop()
    main = loop.create_task(serve(settings, control=Control(live=live, notifier=notifier)))
    pinger = loop.create_task(_watchdog(notifier))

    def stop(name: str) -> None:
        log.warning("%s: draining (requests in flight may finish), then stopping", name)
        notifier.stopping("draining")
        main.cancel()

    def hangup() -> None:
        notifier.reloading()
        live.run()
        notifier.ready("reloaded")

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop, sig.name)
    loop.add_signal_handler(signal.SIGHUP, hangup)
    try:
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(main)
    finally:
        pinger.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(pinger)
        loop.close()
    log.warning("stopped")


async def _watchdog(notifier: Notifier) -> None:
    """`WATCHDOG=1` every half of the service's watchdog interval, from the event loop."""
    if notifier.watchdog_s is None:
        return
    while True:
        notifier.watchdog()
        await asyncio.sleep(notifier.watchdog_s / 2)
