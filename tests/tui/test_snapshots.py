"""The console's looks, pinned as SVG snapshots at 80x24 and 160x48 (pytest-textual-snapshot).

After a deliberate change of looks: `pytest tests/tui/test_snapshots.py --snapshot-update`,
then look at the new SVGs before committing them. The console talks to a fake appliance over
real HTTP; its address is shown as a fixed name so the pictures do not depend on the port.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator

import httpx
import pytest
from textual.pilot import Pilot

from appliance.policy.admission import AdmitCode
from appliance.services.operator.events import EventKind
from tests.tui.conftest import screen_text, wait_until
from tests.tui.fakes import ADMIN_KEY, FakeAppliance, json_reply, make_state, rest_workers
from tui.app import ConsoleApp
from tui.client import Backoff, Lost, Poller, StateClient

SHOWN_URL = "http://appliance.test:8080"
SIZES = [(80, 24), (160, 48)]


class ToFake(httpx.AsyncBaseTransport):
    """Sends requests for SHOWN_URL to the fake appliance's real port."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        request.url = request.url.copy_with(host="127.0.0.1", port=self.port)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def snapshot_state() -> dict[str, object]:
    state = make_state(n_sessions=60, n_tasks=14)
    t = float(state["time"])  # type: ignore[arg-type]
    state["costs"] = {
        "currency": "USD",
        "groups": [
            {
                "task_class": "code",
                "tenant": "alice",
                "tasks": 12,
                "succeeded": 9,
                "attempts": 40,
                "cost": 2.7,
                "overhead": 0.9,
                "total_cost": 3.6,
                "cost_per_success": 0.4,
            },
            {
                "task_class": "research",
                "tenant": "bob",
                "tasks": 5,
                "succeeded": 2,
                "attempts": 17,
                "unpriced_attempts": 2,
                "cost": 1.1,
                "overhead": 0.3,
                "total_cost": 1.4,
                "cost_per_success": 0.7,
            },
        ],
        "overhead": {
            "through": t - 20,
            "idle": 0.95,
            "energy": 0.05,
            "box": 0.2,
            "total": 1.2,
            "awake_gpu_s": 1500.0,
            "idle_gpu_s": 863.6,
            "energy_kwh": 0.2,
            "box_hours": 0.1,
        },
        "series": [
            {
                "window_start": t - 60 * (12 - i),
                "cost_per_success": 0.2 + 0.03 * (i % 5),
                "succeeded": 2 + i,
            }
            for i in range(12)
        ],
    }
    state["admission"] = {
        "accepted": 120,
        "rejected": 7,
        "accept_rate_per_s": 2.5,
        "reject_rate_per_s": 0.1,
        "by_reason": {AdmitCode.DEADLINE_INFEASIBLE: 5, AdmitCode.OVERLOADED: 2},
    }
    state["events"] = [
        {
            "at": t - 3,
            "kind": EventKind.TASK_CANCELLED,
            "subject": "task-0007",
            "tenant": "bob",
            "detail": "cancelled with 2 open descendants",
        },
        {
            "at": t - 40,
            "kind": EventKind.RELEASE,
            "subject": "sess-00004",
            "tenant": "bob",
            "detail": "released by operator: 5,120 tokens held on w1",
        },
        {
            "at": t - 95,
            "kind": EventKind.WORKER_RESTART,
            "subject": "w1",
            "detail": "restarted; 1 restarts since the appliance started",
        },
    ]
    return state


@pytest.fixture
def appliance() -> Iterator[FakeAppliance]:
    fake = FakeAppliance(snapshot_state()).up()
    yield fake
    fake.down()


def app_for(fake: FakeAppliance) -> ConsoleApp:
    client = StateClient(SHOWN_URL, ADMIN_KEY, transport=ToFake(fake.port))
    poller = Poller(client, interval_s=60.0, backoff=Backoff(first_s=30.0, max_s=30.0))
    return ConsoleApp(client, label="appliance.test:8080", poller=poller)


def after(*keys: str) -> Callable[[Pilot[None]], Awaitable[None]]:
    async def run_before(pilot: Pilot[None]) -> None:
        await wait_until(pilot, lambda: pilot.app.state is not None, what="a snapshot")  # type: ignore[attr-defined]
        await pilot.press(*keys)
        await pilot.pause(0.1)

    return run_before


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("tab", ["1", "2", "3", "4", "5"])
def test_tabs(snap_compare, appliance: FakeAppliance, tab: str, size: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(app_for(appliance), terminal_size=size, run_before=after(tab))


def test_overview_without_gpus(snap_compare, appliance: FakeAppliance) -> None:  # type: ignore[no-untyped-def]
    appliance.set_state(make_state(gpus=0, workers=2))
    assert snap_compare(app_for(appliance), terminal_size=(80, 24), run_before=after())


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_overview_with_resting_workers(  # type: ignore[no-untyped-def]
    snap_compare, appliance: FakeAppliance, size: tuple[int, int]
) -> None:
    appliance.set_state(rest_workers(make_state(workers=4)))
    assert snap_compare(app_for(appliance), terminal_size=size, run_before=after())


def test_overview_with_simulated_gpus(snap_compare, appliance: FakeAppliance) -> None:  # type: ignore[no-untyped-def]
    appliance.set_state(make_state(simulated=True))
    assert snap_compare(app_for(appliance), terminal_size=(80, 24), run_before=after())


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_session_detail(snap_compare, appliance: FakeAppliance, size: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    t = float(appliance.state["time"])  # type: ignore[arg-type]
    turns = [
        {
            "turn_id": f"{i:032x}",
            "started_at": t - 30 + 10 * i,
            "worker": "w1",
            "prompt_tokens": 50_000 + 2_000 * i,
            "cached_tokens": 48_000 + 2_000 * i,
            "output_tokens": 120,
            "ttft_s": 0.08,
            "e2e_s": 1.9,
            "cost": 0.0012,
            "outcome": "ok",
        }
        for i in range(3)
    ]
    detail = {
        "residency": [
            {"worker": "w1", "tier": "gpu", "tokens": 57_300, "bytes": 57_300 * 131072},
            {"worker": "w0", "tier": "gpu", "tokens": 8_192, "bytes": 8_192 * 131072},
        ],
        "turns": turns,
    }
    appliance.routes[("GET", "/admin/v1/sessions/sess-00051?tenant=alice")] = json_reply(
        200, detail
    )

    async def run_before(pilot: Pilot[None]) -> None:
        await after("2", "enter")(pilot)
        await wait_until(pilot, lambda: "8,192" in screen_text(pilot.app))

    assert snap_compare(app_for(appliance), terminal_size=size, run_before=run_before)


def test_release_confirmation(snap_compare, appliance: FakeAppliance) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(app_for(appliance), terminal_size=(80, 24), run_before=after("2", "x"))


def test_help(snap_compare, appliance: FakeAppliance) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(
        app_for(appliance), terminal_size=(80, 24), run_before=after("2", "question_mark")
    )


def test_connection_lost_banner(snap_compare, appliance: FakeAppliance) -> None:  # type: ignore[no-untyped-def]
    async def run_before(pilot: Pilot[None]) -> None:
        await after("2")(pilot)
        appliance.down()
        app = pilot.app
        assert isinstance(app, ConsoleApp)
        app.poller.wake()
        await wait_until(pilot, lambda: isinstance(app.link, Lost), what="the outage")
        await pilot.pause(0.1)

    assert snap_compare(app_for(appliance), terminal_size=(80, 24), run_before=run_before)
