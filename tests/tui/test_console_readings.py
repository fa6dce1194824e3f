"""Pilot tests of what the console reads out, against the fake appliance. Where the figure
is the point, the fake serves what the product's own code builds (the sim worker's /metrics
through the metrics reader, the simulated GPU model, the session table and SessionKv, all
through the state document), so the console is checked against what the appliance publishes.

Workers' KV use counts what is cached, not only running requests; simulated GPUs heat and
draw power with their load; a session under one block says why it has no decision; a
release's figure is the same in the dialog, the toast and the detail, whose residency
follows; the cost chart has a scale; a refused key is named once and not retried.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from appliance.api.admin.schemas import plain
from appliance.api.admin.state_document import gpu_document, session_document, worker_document
from appliance.domain.block_hash import BlockHasher, HashAlgo
from appliance.domain.records import SessionId, TenantId, WorkerId
from appliance.domain.worker import WorkerState, WorkerStatus
from appliance.engines.clients.metrics import load_snapshot
from appliance.gpu.simulated import SimulatedGpuProbe
from appliance.perf.kv_capacity import SIM_GPU_MEMORY_UTILIZATION, default_num_gpu_blocks
from appliance.perf.profile import bundled_profile
from appliance.services.operator.state import session_view
from appliance.services.residency.session_kv import SessionKv
from appliance.services.sessions.sessions import SessionState, SessionTable, TurnBegan, TurnEnded
from appliance.services.workers.gpu_meter import GpuTime
from appliance.sim.core.engine_stats import EngineStats
from appliance.sim.entrypoints.metrics import SimMetrics, cache_config_labels
from tests.tui.conftest import FAST_S, console, screen_text, until_text, wait_until
from tests.tui.fakes import SIM_GPU, T0, FakeAppliance, json_reply, make_state
from tui import format as fmt
from tui.app import console_app
from tui.client import Backoff, Lost, Poller
from tui.screens.dialogs import ConfirmScreen
from tui.screens.session_detail import SessionDetailScreen

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def started(app: Any, pilot: Any) -> None:
    await wait_until(pilot, lambda: app.state is not None, what="the first snapshot")
    await pilot.pause()


# -- 1. a worker's KV use --------------------------------------------------------------------
def sim_worker(worker: str, kv_tokens: int) -> dict[str, Any]:
    """A simulated worker between turns as the state publishes it: its load read from the
    sim's own /metrics (nothing running: vLLM's usage 0), its KV tokens the KV index's."""
    block = 16
    blocks = default_num_gpu_blocks(bundled_profile(), block, SIM_GPU_MEMORY_UTILIZATION)
    labels = cache_config_labels(
        block_size=block,
        num_gpu_blocks=blocks,
        max_model_len=8192,
        hash_algo="sha256_cbor",
        kv_cache_memory_bytes=None,
    )
    idle = EngineStats(
        num_running=0,
        num_waiting=0,
        kv_cache_usage=0.0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        prompt_tokens_total=0,
        prompt_tokens_by_source={},
        generation_tokens_total=0,
        num_preemptions_total=0,
        request_success_total={},
    )
    text = SimMetrics(model_name="sim", max_model_len=8192, cache_config=labels).render(idle)
    status = WorkerStatus(
        WorkerId(worker),
        "sim",
        "http://127.0.0.1:8100",
        (),
        WorkerState.HEALTHY,
        False,
        0,
        load=load_snapshot(text, now=0.0),
    )
    return plain(worker_document(status, 1.0, kv_tokens, None))


async def test_a_workers_kv_use_counts_its_cached_kv_not_only_running_requests(
    fake: FakeAppliance,
) -> None:
    state = make_state()
    state["workers"] = [sim_worker("w0", 1248), sim_worker("w1", 5824)]
    assert {w["kv_usage"] for w in state["workers"]} == {0.0}  # vLLM's: nothing running
    fake.set_state(state)
    app = console(fake.url)
    async with app.run_test(size=(120, 36)) as pilot:
        await started(app, pilot)
        rows = {
            line.split()[0]: line
            for line in screen_text(app).splitlines()
            if line.strip().startswith(("w0 ", "w1 "))
        }
        assert " 0.1% " in rows["w0"] and "1248" in rows["w0"]  # of a 935,600-token pool
        assert " 0.6% " in rows["w1"] and "5824" in rows["w1"]


# -- 2. simulated GPUs' power and temperature ------------------------------------------------
class Meter:
    """The router's GPU meter: w0 busy all the time, w1 idle."""

    def __init__(self) -> None:
        self.now = 0.0

    def reading(self, worker: WorkerId) -> GpuTime:
        return GpuTime(awake_s=self.now, busy_s=self.now if worker == "w0" else 0.0)


async def test_simulated_gpus_heat_and_draw_power_with_their_load(fake: FakeAppliance) -> None:
    state = make_state(simulated=True)
    endpoints = [
        WorkerStatus(WorkerId(w["id"]), "sim", w["url"], (), WorkerState.HEALTHY, False, 0)
        for w in state["workers"]
    ]
    meter = Meter()
    probe = SimulatedGpuProbe(SIM_GPU, lambda: endpoints, meter=meter, clock=lambda: meter.now)
    app = console(fake.url)
    async with app.run_test(size=(120, 36)) as pilot:
        # Readings every half second, as the appliance takes them; the console sees the
        # state after 10 s, 60 s and 4 min of w0 busy and w1 idle.
        for until_s, w0_temp in ((10.0, "50°C"), (60.0, "70°C"), (240.0, "75°C")):
            while meter.now < until_s:
                meter.now += 0.5
                readings = probe.snapshot().gpus
            state["gpus"] = [plain(gpu_document(g)) for g in readings]
            state["time"] = T0 + until_s
            fake.set_state(json.loads(json.dumps(state)))
            await until_text(pilot, fmt.clock(T0 + until_s))
            lines = [line for line in screen_text(app).splitlines() if "H200 sim" in line]
            # w0 draws its TDP at once; its temperature lags (30 s time constant) toward 75 C.
            assert f"util 100% {w0_temp} 700 W" in lines[0]
            assert "util   0% 40°C 100 W" in lines[1]


# -- 3. a session under one block ------------------------------------------------------------
class Reaper:
    """The idle reaper as the session table and SessionKv see it, for a session whose
    prompt is under one block: its loop returns before deciding (`prefix_tokens` is 0; see
    tests/unit/test_session_kv.py for the real loop), so it has no decision on it."""

    retention = None

    def turn_began(self, event: TurnBegan) -> None:
        pass

    def turn_ended(self, event: TurnEnded) -> None:
        pass

    def decision_of(self, session: SessionState) -> None:
        return None


async def test_a_session_under_one_block_says_why_it_has_no_decision(fake: FakeAppliance) -> None:
    table = SessionTable(BlockHasher(HashAlgo.SHA256_CBOR, 16), subscribers=(Reaper(),))
    short = table.open(TenantId("alice"), SessionId("sess-short"), 1000.0)
    table.hash_prompt(short, list(range(100, 109)), "salt")  # 9 tokens of a 16-token block
    table.began(short, 1000.0)
    short.home = WorkerId("w0")
    table.ended(short, 1001.0)
    kv = SessionKv(lambda x: {"gpu": {WorkerId("w0"): 0}, "host": {}}, None, Reaper())  # type: ignore[arg-type]
    row = session_document(session_view(short, 1200.0, 131072, kv.now(short)))
    state = make_state(n_sessions=2)
    state["sessions"].append(plain(row))
    fake.set_state(state)
    app = console(fake.url)
    async with app.run_test(size=(160, 40)) as pilot:
        await started(app, pilot)
        app.push_screen(SessionDetailScreen("sess-short", "alice"))
        await until_text(pilot, "Session sess-short")
        text = screen_text(app)
        assert "nothing cached: prompt under one block (9 of 16 tokens)" in text
        assert "no residency decision yet" not in text


# -- 4. a release: one figure, and the residency follows -------------------------------------
async def test_a_release_says_one_figure_and_the_residency_follows(fake: FakeAppliance) -> None:
    state = make_state(n_sessions=2)
    sid, tenant, per_token = "sess-00001", "bob", 131072
    session = state["sessions"][1]
    session.update(
        resident_tokens={"gpu": 96, "host": 0, "gpu_held": 96, "gone": 0},
        resident_bytes={"gpu": 96 * per_token, "host": 0, "gpu_held": 96 * per_token, "gone": 0},
        decision="hold",
        reason="hold: HBM has room",
        held_until=state["time"] + 30,
    )
    fake.set_state(state)
    held = {
        "worker": "w1",
        "tier": "gpu_held",
        "tokens": 96,
        "bytes": 96 * per_token,
        "held_until": state["time"] + 30,
    }
    detail = f"/admin/v1/sessions/{sid}?tenant={tenant}"
    fake.routes[("GET", detail)] = json_reply(200, {"residency": [held], "turns": []})
    fake.routes[("POST", f"/admin/v1/sessions/{sid}/release?tenant={tenant}")] = json_reply(
        200, {"session_id": sid, "tenant": tenant, "released_tokens": 96}
    )
    app = console(fake.url)
    async with app.run_test(size=(120, 36), notifications=True) as pilot:
        await started(app, pilot)
        app.push_screen(SessionDetailScreen(sid, tenant))
        await until_text(pilot, "w1      gpu_held")
        await pilot.press("x")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        assert "96 tokens / 12.0 MiB on GPU, 96 of them held until" in screen_text(app)
        await pilot.click("#yes")
        await wait_until(pilot, lambda: bool(app._notifications), what="a notification")
        assert list(app._notifications)[-1].message == f"Session {sid}: released (96 tokens)."

        def reads(path: str) -> int:
            return sum(1 for r in fake.requests if r.method == "GET" and r.path == path)

        await wait_until(pilot, lambda: reads(detail) == 2, what="the detail read again")
        # Its holds go once the worker reports it, a moment after the answer (the detail read
        # just after the release still lists them); its blocks stay cached. The residency
        # follows the snapshot that shows it.
        unheld = {**held, "tier": "gpu"}
        del unheld["held_until"]
        fake.routes[("GET", detail)] = json_reply(200, {"residency": [unheld], "turns": []})
        fake.routes[("GET", detail + "&turns=1")] = fake.routes[("GET", detail)]
        released = json.loads(json.dumps(state))
        released["sessions"][1]["resident_tokens"]["gpu_held"] = 0
        released["sessions"][1].update(decision="released", reason="released by operator")
        fake.set_state(released)
        await until_text(pilot, "released by operator")
        await until_text(pilot, "w1      gpu       ")
        text = screen_text(app)
        assert "0 tokens until" in text and "gpu_held" not in text
        assert reads(detail + "&turns=1") >= 1  # read again because the snapshot changed


# -- 5. the cost chart's scale ---------------------------------------------------------------
async def test_the_cost_chart_has_labelled_axes(fake: FakeAppliance) -> None:
    state = make_state()
    t = state["time"]
    state["costs"] = {
        "currency": "USD",
        "groups": [],
        "series": [
            {"window_start": t - 10 * (6 - i), "cost_per_success": c, "succeeded": 1}
            for i, c in enumerate([0.1, 0.2, None, 0.4, 0.3, 0.2])
        ],
    }
    fake.set_state(state)
    app = console(fake.url)
    async with app.run_test(size=(120, 40)) as pilot:
        await started(app, pilot)
        await pilot.press("4")
        await until_text(pilot, "cost per successful task, USD")
        lines = screen_text(app).splitlines()
        top = next(i for i, line in enumerate(lines) if "0.4000 ┤" in line)
        assert "0.2000 ┤" in lines[top + 3]  # half, halfway down six rows
        assert "0 └──" in lines[top + 6]
        assert "23:59:00Z" in lines[top + 7] and "23:59:50Z" in lines[top + 7]
        assert "window start (UTC), one bar per 10s window" in lines[top + 8]


# -- 6. a refused key ------------------------------------------------------------------------
async def test_a_refused_key_is_named_once_with_its_data_dir_and_not_retried(
    fake: FakeAppliance, tmp_path: Path
) -> None:
    (tmp_path / "api-keys.toml").write_text(
        '[keys.ops]\nkey = "sk-stale-secret"\nadmin = true\ncreated_at = "2026-01-01"\n'
    )
    app = console_app(fake.url, None, tmp_path)
    app.poller = Poller(app.client, interval_s=0.2, backoff=Backoff(first_s=FAST_S, max_s=0.2))
    async with app.run_test(size=(160, 40)) as pilot:
        await until_text(pilot, "key refused")
        await wait_until(pilot, lambda: "r tries again" in " ".join(screen_text(app).split()))
        text = " ".join(screen_text(app).split())
        assert f'operator key "ops" from {tmp_path}/api-keys.toml (data dir {tmp_path})' in text
        assert f"the appliance at {fake.url} does not know it" in text
        assert "pass the data dir the appliance runs on (--data-dir DIR)" in text
        assert '--key "$(appliance keys show NAME --data-dir DIR)"' in text
        assert "sk-stale-secret" not in text
        assert "· not retrying: r tries again ·" in text
        assert isinstance(app.link, Lost) and not app.link.retrying
        asked = fake.state_requests()
        await pilot.pause(0.6)  # a dozen retries at this backoff, had it retried
        assert fake.state_requests() == asked == 1
        await pilot.press("r")  # the operator tries once more
        await wait_until(pilot, lambda: fake.state_requests() == 2)
