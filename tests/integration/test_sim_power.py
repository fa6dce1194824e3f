"""The simulated engine as `appliance up --engine sim` starts it (the composition root's
`start_engines`, real worker processes): `Engines.power` stops, wakes and sleeps its
workers, the wakes take the GPU profile's modelled times, and the wired appliance's event
feed shows them in `/admin/v1/state`, the measured wake time in the detail.

The time scale shrinks the bundled profile's ~43 s stopped wake to ~2 s; durations are
checked as lower bounds only (a wake never ends before its modelled time).
"""

from __future__ import annotations

import re
from pathlib import Path

from starlette.testclient import TestClient

from appliance.api.auth import Caller
from appliance.config.settings import EngineKind, Settings
from appliance.domain.records import TenantId, WorkerId
from appliance.domain.worker import WorkerState
from appliance.engines.clients.workers import KvIndexFeed
from appliance.engines.supervision.sim_launch import SIM_PROCESS_START_S
from appliance.gpu.fake import FakeProbe
from appliance.ledger import LedgerWriter
from appliance.oplog import LoggedEventFeed
from appliance.perf.profile import bundled_profile
from appliance.services.workers.worker_watch import power_event_sink
from appliance.start.engine_start import runtime_identity, start_engines
from appliance.start.wiring import StartedEngines, wire
from tests.fakes import ManualClock
from tests.loop_thread import LoopThread
from tests.ports import free_port_block

SCALE = 0.05
WAKE = bundled_profile().wake
assert WAKE is not None


def _settings(tmp_path: Path) -> Settings:
    engine = {
        "kind": "sim",
        "workers": 1,
        "base_port": free_port_block(1),
        "kv_events_base_port": free_port_block(1),
        "kv_retention_base_port": free_port_block(1),
        "sim_time_scale": SCALE,
    }
    return Settings(data_dir=tmp_path, engine=engine)


def _admin_events(
    settings: Settings,
    engines: StartedEngines,
    feed: KvIndexFeed,
    events: LoggedEventFeed,
    ledger: LedgerWriter,
) -> TestClient:
    wired = wire(
        settings,
        engines=engines,
        ledger=ledger,
        feed=feed,
        clock=ManualClock(),
        probe=FakeProbe([[]]),
        profile=bundled_profile(),
        keys={"ops": Caller(TenantId("ops"), True)},
        secret=b"s" * 32,
        events=events,
    )
    return TestClient(wired.app)


def test_a_sim_worker_is_stopped_woken_and_slept_by_engines_power(tmp_path: Path) -> None:
    settings, feed, events = _settings(tmp_path), KvIndexFeed(), LoggedEventFeed()
    loop, ledger = LoopThread(), LedgerWriter.open(tmp_path / "ledger.db")
    started = start_engines(
        settings, EngineKind.SIM, feed, tmp_path / "logs", power_event_sink(events)
    )
    try:
        engines = loop.run(started.__aenter__())
        assert engines.power is not None
        w0, wid = engines.workers[0], WorkerId("w0")
        assert (w0.engine, w0.can_sleep, w0.state) == ("sim", True, WorkerState.HEALTHY)
        identity = runtime_identity(settings, EngineKind.SIM)
        view = StartedEngines(lambda: engines.workers, "sim", engines.max_model_len, identity)
        http = _admin_events(settings, view, feed, events, ledger)

        stopped = loop.run(engines.power.stop(wid))
        assert stopped.before == WorkerState.HEALTHY
        assert (w0.state, w0.pid) == (WorkerState.STOPPED, None)
        woken = loop.run(engines.power.wake(wid))
        load_s = (WAKE.stopped.seconds - SIM_PROCESS_START_S) * SCALE
        assert woken.duration_s >= load_s, "a start that wakes models the stopped wake"
        assert (woken.after, w0.state, w0.restarts) == (WorkerState.HEALTHY, WorkerState.HEALTHY, 0)

        slept = loop.run(engines.power.sleep(wid, 2))
        assert (slept.after, w0.sleep_level) == (WorkerState.ASLEEP, 2)
        again = loop.run(engines.power.wake(wid))
        assert again.duration_s >= WAKE.asleep_2.seconds * SCALE

        state = http.get("/admin/v1/state", headers={"Authorization": "Bearer ops"}).json()
        shown = [(e["kind"], e["detail"]) for e in reversed(state["events"])]
        assert [k for k, _ in shown] == [
            "worker_stopped",
            "worker_waking",
            "worker_woken",
            "worker_slept",
            "worker_waking",
            "worker_woken",
        ]
        assert re.fullmatch(r"woke from stopped in \d+\.\d\d s", shown[2][1])
        assert re.fullmatch(r"woke from sleep level 2 in \d+\.\d\d s", shown[5][1])
    finally:
        loop.run(started.__aexit__(None, None, None))
        ledger.close()
        loop.close()
