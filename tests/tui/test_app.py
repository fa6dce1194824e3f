"""Pilot tests: every screen and key of the console against a fake appliance on a real port."""

from __future__ import annotations

import json
import time

import pytest

from appliance.api.admin.schemas import convert_state
from appliance.policy.admission import AdmitCode
from appliance.services.operator.events import EventKind
from appliance.services.residency.session_kv import NO_DECISION_REASON
from tests.tui.conftest import console, screen_text, until_text, wait_until
from tests.tui.fakes import FakeAppliance, json_reply, make_state, rest_workers
from tui import format as fmt
from tui.app import ConsoleApp
from tui.client import Lost
from tui.messages import StateUpdated
from tui.screens.dialogs import ConfirmScreen, HelpScreen
from tui.screens.session_detail import SessionDetailScreen
from tui.screens.sessions import SessionGrid, SessionsScreen
from tui.screens.tasks import TasksScreen, TaskTreeWidget
from tui.widgets.panels import worker_state_cell

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def sessions_in_view(app: ConsoleApp) -> list[str]:
    return [s.id for s in app.screen.query_one(SessionGrid).view]


async def started(app: ConsoleApp, pilot) -> None:  # type: ignore[no-untyped-def]
    await wait_until(pilot, lambda: app.state is not None, what="the first snapshot")
    await pilot.pause()


# -- overview ------------------------------------------------------------------------------
async def test_overview_shows_gpu_bars_workers_and_the_summary(fake: FakeAppliance) -> None:
    app = console(fake.url)
    async with app.run_test(size=(120, 36)) as pilot:
        await started(app, pilot)
        text = screen_text(app)
        assert "GPU0 H200" in text and "GPU1 H200" in text
        assert "88.0/141.0 GiB" in text and "109.0/141.0 GiB" in text
        assert "▓" in text and "░" in text
        assert "util  55%" in text and "51°C" in text and "402 W" in text
        assert "KV (not reported)" in text
        for line in ("w0      sim     awake", "w1      sim     awake"):
            assert line in text
        assert "41%" in text and "62%" in text  # kv use, prefix hit of w0
        assert "sessions   12" in text
        assert "admission  not reported by this appliance yet" in text
        assert "routing    least_ttft 9 · prefix_resident 40" in text


async def test_overview_says_the_simulated_gpus_are_simulated(fake: FakeAppliance) -> None:
    state = make_state(simulated=True)
    state["admission"] = {
        "accepted": 120,
        "rejected": 7,
        "accept_rate_per_s": 2.5,
        "reject_rate_per_s": 0.1,
        "by_reason": {AdmitCode.DEADLINE_INFEASIBLE: 5, AdmitCode.OVERLOADED: 2},
    }
    fake.set_state(state)
    app = console(fake.url)
    async with app.run_test(size=(120, 36)) as pilot:
        await started(app, pilot)
        text = screen_text(app)
        assert "GPU0 H200 sim" in text and "GPU1 H200 sim" in text
        assert "61.8/140.4 GiB KV 46.8" in text  # 15.0 GiB baseline + 41% of the KV pool
        assert "█" in text and "▓" in text and "░" in text
        assert "simulated by the sim engine's GPU model, not measured" in text
        assert "KV (not reported)" not in text
        assert "accept 2.5/s · reject 0.1/s · accepted 120 · rejected 7" in text
        assert "deadline_infeasible 5, overloaded 2" in text


async def test_overview_without_gpus_says_so_calmly(fake: FakeAppliance) -> None:
    fake.set_state(make_state(gpus=0))
    app = console(fake.url)
    async with app.run_test(size=(100, 30)) as pilot:
        await started(app, pilot)
        text = screen_text(app)
        assert "No NVIDIA GPU reported: NVML sees none on this host." in text
        assert "GPU0" not in text
        assert "w0      sim     awake" in text


async def test_sleeping_waking_and_stopped_workers_show_as_such_not_as_down(
    fake: FakeAppliance,
) -> None:
    fake.set_state(rest_workers(make_state(workers=4)))
    app = console(fake.url)
    async with app.run_test(size=(120, 36)) as pilot:
        await started(app, pilot)
        text = screen_text(app)
        for line in (
            "w1      sim     asleep L2",
            "w2      sim     waking",
            "w3      sim     stopped",
        ):
            assert line in text
        assert "down" not in text
        assert " 3.2s " in text  # w0's latest wake (wide enough for the wake column)
        styles = {w.id: str(worker_state_cell(w).style) for w in app.state.workers}  # type: ignore[union-attr]
        assert styles == {"w0": "green", "w1": "dim", "w2": "bold yellow", "w3": "dim red"}
        state = rest_workers(make_state(workers=4, tick=1))
        state["workers"][1]["healthy"] = True  # w1 woke; an awake one failing is a fault
        state["workers"][1].update(state="awake", sleep_level=None)
        state["workers"][0]["healthy"] = False
        fake.set_state(state)
        await until_text(pilot, "w1      sim     awake")
        assert "w0      sim     down" in screen_text(app)
        assert str(worker_state_cell(app.state.workers[0]).style) == "bold red"  # type: ignore[union-attr]


async def test_the_header_shows_the_appliances_version(fake: FakeAppliance) -> None:
    state = make_state()
    state["version"] = "9.8.7"
    fake.set_state(state)
    app = console(fake.url)
    async with app.run_test(size=(120, 36)) as pilot:
        await started(app, pilot)
        assert "v9.8.7" in screen_text(app).splitlines()[0]


async def test_overview_follows_new_snapshots(fake: FakeAppliance) -> None:
    app = console(fake.url)
    async with app.run_test(size=(120, 36)) as pilot:
        await started(app, pilot)
        state = make_state(tick=4)
        state["workers"][0]["restarts"] = 7
        state["workers"][0]["healthy"] = False
        fake.set_state(state)
        await until_text(pilot, "w0      sim     down")
        assert "00:00:02Z" in screen_text(app)


# -- sessions ------------------------------------------------------------------------------
async def test_sessions_sort_by_key_and_by_header(fake: FakeAppliance) -> None:
    app = console(fake.url)
    async with app.run_test(size=(160, 40)) as pilot:
        await started(app, pilot)
        await pilot.press("2")
        await until_text(pilot, "GPU tok▼")
        sessions = {s["id"]: s for s in fake.state["sessions"]}
        view = sessions_in_view(app)
        gpu = [sessions[i]["resident_tokens"]["gpu"] for i in view]
        assert gpu == sorted(gpu, reverse=True) and len(view) == 12
        await pilot.press("S")
        await until_text(pilot, "GPU tok▲")
        gpu = [sessions[i]["resident_tokens"]["gpu"] for i in sessions_in_view(app)]
        assert gpu == sorted(gpu)
        await pilot.press("s")  # next sortable column: host tokens, same direction
        await until_text(pilot, "host tok▲")
        await pilot.click(SessionGrid, offset=(2, 0))  # the "session" header
        await until_text(pilot, "session▲")
        assert sessions_in_view(app) == sorted(sessions)
        await pilot.click(SessionGrid, offset=(2, 0))
        await until_text(pilot, "session▼")
        assert sessions_in_view(app) == sorted(sessions, reverse=True)
        assert "sorted by session ▼" in screen_text(app)


async def test_sessions_filter_narrows_and_escape_clears(fake: FakeAppliance) -> None:
    app = console(fake.url)
    async with app.run_test(size=(160, 40)) as pilot:
        await started(app, pilot)
        await pilot.press("2", "slash")
        await pilot.press(*"carol")
        await until_text(pilot, "4 match “carol”")
        assert {s.tenant for s in app.screen.query_one(SessionGrid).view} == {"carol"}
        await pilot.press("enter")  # back to the table; the filter stays
        assert app.screen.query_one(SessionGrid).has_focus
        await pilot.press("escape")
        await wait_until(pilot, lambda: len(sessions_in_view(app)) == 12)
        assert "match" not in screen_text(app)


async def test_sessions_filter_survives_refreshes_and_cursor_follows_its_row(
    fake: FakeAppliance,
) -> None:
    app = console(fake.url)
    async with app.run_test(size=(160, 40)) as pilot:
        await started(app, pilot)
        await pilot.press("2", "down", "down")
        grid = app.screen.query_one(SessionGrid)
        chosen = grid.selected
        assert chosen is not None
        state = make_state()
        for s in state["sessions"]:  # the chosen row moves to the top, the rest down
            s["resident_tokens"]["gpu"] = 10**6 if s["id"] == chosen.id else 1
        fake.set_state(state)
        await wait_until(pilot, lambda: sessions_in_view(app)[0] == chosen.id)
        assert grid.cursor == 0 and grid.selected is not None and grid.selected.id == chosen.id


async def test_enter_opens_the_session_and_escape_goes_back(fake: FakeAppliance) -> None:
    app = console(fake.url)
    async with app.run_test(size=(120, 36)) as pilot:
        await started(app, pilot)
        await pilot.press("2")
        first = sessions_in_view(app)[0]
        await pilot.press("enter")
        await wait_until(pilot, lambda: isinstance(app.screen, SessionDetailScreen))
        await until_text(pilot, f"Session {first}")
        await until_text(pilot, "404 Not Found")  # this appliance has no turns route yet
        text = screen_text(app)
        assert NO_DECISION_REASON in text
        tenant = next(x["tenant"] for x in fake.state["sessions"] if x["id"] == first)
        assert f"GET /admin/v1/sessions/{first}?tenant={tenant}" in [
            f"{r.method} {r.path}" for r in fake.requests
        ]
        await pilot.press("escape")
        await wait_until(pilot, lambda: isinstance(app.screen, SessionsScreen))


async def test_session_detail_shows_turns_when_the_appliance_has_them(
    fake: FakeAppliance,
) -> None:
    first = "sess-00003"
    turns = {
        "session": None,
        "residency": [{"worker": "w1", "tier": "gpu", "tokens": 4608, "bytes": 4608 * 131072}],
        "turns": [
            {
                "turn_id": "t-1",
                "started_at": 1_767_225_600.0,
                "worker": "w1",
                "prompt_tokens": 5000,
                "cached_tokens": 4096,
                "output_tokens": 64,
                "ttft_s": 0.12,
                "e2e_s": 1.5,
                "cost": 0.0021,
                "outcome": "ok",
            }
        ],
    }
    fake.routes[("GET", f"/admin/v1/sessions/{first}")] = json_reply(200, turns)
    app = console(fake.url)
    async with app.run_test(size=(120, 36)) as pilot:
        await started(app, pilot)
        app.push_screen(SessionDetailScreen(first))
        await until_text(pilot, "t-1")
        text = screen_text(app)
        assert "4,096" in text and "0.0021" in text and "ok" in text
        assert "w1      gpu    4,608  576.0 MiB" in text
        fake.set_state(make_state(n_sessions=2))
        await until_text(pilot, "This session is no longer in the appliance's state.")


async def test_release_asks_first_and_cancel_sends_nothing(fake: FakeAppliance) -> None:
    app = console(fake.url)
    async with app.run_test(size=(120, 36)) as pilot:
        await started(app, pilot)
        await pilot.press("2", "x")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        target = app.screen_stack[-2].query_one(SessionGrid).selected
        assert target is not None
        assert f"Release the KV cache held by session {target.id}" in screen_text(app)
        await pilot.press("n")
        await wait_until(pilot, lambda: isinstance(app.screen, SessionsScreen))
        await pilot.press("x", "escape")
        await wait_until(pilot, lambda: isinstance(app.screen, SessionsScreen))
        await pilot.pause(0.2)
        assert not [r for r in fake.requests if r.method == "POST"]


async def test_release_confirmed_shows_the_servers_404(fake: FakeAppliance) -> None:
    app = console(fake.url)
    async with app.run_test(size=(120, 36), notifications=True) as pilot:
        await started(app, pilot)
        await pilot.press("2")
        target = app.screen.query_one(SessionGrid).selected
        assert target is not None
        await pilot.press("x")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        path = f"/admin/v1/sessions/{target.id}/release?tenant={target.tenant}"
        await wait_until(pilot, lambda: any(r.path == path for r in fake.requests))
        await wait_until(pilot, lambda: bool(app._notifications), what="a notification")
        note = list(app._notifications)[-1]
        assert note.severity == "error"
        assert note.message == (
            f"The appliance refused to release session {target.id}: 404 Not Found"
        )
        assert [r.method for r in fake.requests if r.path == path] == ["POST"]


async def test_release_confirmed_from_the_detail_view_reports_success(
    fake: FakeAppliance,
) -> None:
    fake.routes[("POST", "/admin/v1/sessions/sess-00001/release?tenant=bob")] = json_reply(
        200, {"session_id": "sess-00001", "tenant": "bob", "released_tokens": 5120}
    )
    app = console(fake.url)
    async with app.run_test(size=(120, 36), notifications=True) as pilot:
        await started(app, pilot)
        app.push_screen(SessionDetailScreen("sess-00001", "bob"))
        await until_text(pilot, "Session sess-00001")
        await pilot.press("x")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.click("#yes")
        await wait_until(pilot, lambda: bool(app._notifications), what="a notification")
        note = list(app._notifications)[-1]
        assert note.severity == "information"
        assert note.message == "Session sess-00001: released (5,120 tokens)."


# -- tasks ---------------------------------------------------------------------------------
async def test_tasks_show_the_fan_out_and_keep_what_was_collapsed(fake: FakeAppliance) -> None:
    fake.set_state(make_state(n_sessions=4, n_tasks=6))
    app = console(fake.url)
    async with app.run_test(size=(120, 36)) as pilot:
        await started(app, pilot)
        await pilot.press("3")
        await until_text(pilot, "6 tasks")
        tasks = {t["id"]: t for t in fake.state["tasks"]}
        parent = next(t for t in tasks.values() if t["children"])
        kids = parent["children"]
        text = screen_text(app)
        assert f"{parent['id']}" in text and all(k in text for k in kids)
        assert "├─" in text or "└─" in text
        screen = app.screen
        assert isinstance(screen, TasksScreen)
        tree = screen.query_one(TaskTreeWidget)
        node = screen._task_nodes[parent["id"]]
        assert node.is_expanded
        tree.move_cursor(node)
        await pilot.press("enter")
        await wait_until(pilot, lambda: not node.is_expanded)
        await wait_until(pilot, lambda: not any(k in screen_text(app) for k in kids))
        state = make_state(n_sessions=4, n_tasks=6, tick=2)  # same tree, new numbers
        fake.set_state(state)
        await until_text(pilot, "00:00:01Z")
        assert not screen._task_nodes[parent["id"]].is_expanded
        await pilot.press("e")
        await wait_until(pilot, lambda: all(k in screen_text(app) for k in kids))
        await pilot.press("c")
        await wait_until(pilot, lambda: not any(k in screen_text(app) for k in kids))
        await pilot.press("space")
        await wait_until(pilot, lambda: any(k in screen_text(app) for k in kids))


async def test_tasks_show_status_slack_tokens_and_new_children(fake: FakeAppliance) -> None:
    state = make_state(n_sessions=2, n_tasks=3)
    for t in state["tasks"]:
        t["parent_id"], t["children"] = None, []
    state["tasks"][0].update(deadline_at=state["time"] - 5, status="open")
    fake.set_state(state)
    app = console(fake.url)
    async with app.run_test(size=(120, 30)) as pilot:
        await started(app, pilot)
        await pilot.press("3")
        await until_text(pilot, "task-0000 [code]  open  slack -5.0s  1000 tok  cost -")
        grown = json.loads(json.dumps(state))
        grown["tasks"].append(
            {
                "id": "task-kid",
                "parent_id": "task-0000",
                "tenant": "alice",
                "task_class": None,
                "status": "succeeded",
                "deadline_at": None,
                "tokens": 42,
                "cost": 0.5,
                "children": [],
                "kv_inherited_tokens": 4096,
                "kv_reclaimed_tokens": 640,
                "kv_reclaimed_at": state["time"] - 1,
            }
        )
        grown["tasks"][0]["children"] = ["task-kid"]
        grown["tasks"][0].update(kv_own_tokens=12_800, kv_own_kept_tokens=512)
        fake.set_state(grown)
        await until_text(pilot, "└─ task-kid  succeeded  42 tok  cost 0.5000  kv 4096 inherited")
        text = screen_text(app)
        assert "· 0 own (0 kept)  reclaimed 640 at " + fmt.clock(state["time"] - 1) in text
        assert "(1 child)  kv 0 inherited · 12.8k own (512 kept)" in text
        assert text.count("reclaimed") == 1  # an open task has reclaimed nothing


# -- costs and events ----------------------------------------------------------------------
async def test_costs_not_reported_then_reported(fake: FakeAppliance) -> None:
    app = console(fake.url)
    async with app.run_test(size=(120, 30)) as pilot:
        await started(app, pilot)
        await pilot.press("4")
        await until_text(pilot, "This appliance does not report costs in its state yet.")
        state = make_state()
        state["costs"] = {
            "currency": "USD",
            "groups": [
                {
                    "task_class": "code",
                    "tenant": "alice",
                    "tasks": 10,
                    "succeeded": 8,
                    "attempts": 31,
                    "unpriced_attempts": 0,
                    "cost": 1.6,
                    "cost_per_success": 0.2,
                }
            ],
            "series": [
                {"window_start": state["time"] - 60 * i, "cost_per_success": 0.1 * i}
                for i in range(5, 0, -1)
            ],
        }
        fake.set_state(state)
        await until_text(pilot, "0.2000 USD")
        text = screen_text(app)
        assert "code" in text and "alice" in text and "1.60 USD" in text
        assert "5 windows from 23:55:00Z to 23:59:00Z" in text
        assert "last 0.1000 USD" in text


async def test_events_newest_first(fake: FakeAppliance) -> None:
    app = console(fake.url)
    async with app.run_test(size=(120, 30)) as pilot:
        await started(app, pilot)
        await pilot.press("5")
        await until_text(pilot, "this appliance does not report events in its state yet")
        state = make_state()
        t = state["time"]
        state["events"] = [
            {
                "at": t - 30,
                "kind": EventKind.WORKER_RESTART,
                "subject": "w1",
                "detail": "exit code 1",
            },
            {
                "at": t - 5,
                "kind": EventKind.TASK_CANCELLED,
                "subject": "task-0001",
                "tenant": "bob",
            },
            {"at": t - 10, "kind": EventKind.RELEASE, "subject": "sess-00002", "tenant": "carol"},
        ]
        fake.set_state(state)
        await until_text(pilot, "3 events")
        lines = [line for line in screen_text(app).splitlines() if "Z " in line[:10]]
        assert [line.split()[1:3] for line in lines] == [
            ["task_cancelled", "task-0001"],
            ["release", "sess-00002"],
            ["worker_restart", "w1"],
        ]


# -- help, keys, quitting ------------------------------------------------------------------
async def test_help_lists_the_keys_of_the_screen_below(fake: FakeAppliance) -> None:
    app = console(fake.url)
    async with app.run_test(size=(120, 40)) as pilot:
        await started(app, pilot)
        await pilot.press("2", "question_mark")
        await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen))
        text = screen_text(app)
        for words in ("Release KV", "Filter", "Reverse", "Quit", "Refresh", "move the cursor"):
            assert words in text
        await pilot.press("escape")
        await wait_until(pilot, lambda: isinstance(app.screen, SessionsScreen))


async def test_the_footer_shows_the_keys(fake: FakeAppliance) -> None:
    app = console(fake.url)
    async with app.run_test(size=(120, 30)) as pilot:
        await started(app, pilot)
        await pilot.press("2")
        await until_text(pilot, "x Release KV")
        footer = screen_text(app).splitlines()[-1]
        for key in ("/ Filter", "s Sort", "S Reverse", "r Refresh", "? Help", "q Quit"):
            assert key in footer


async def test_r_refreshes_now(fake: FakeAppliance) -> None:
    app = console(fake.url, interval_s=30.0)
    async with app.run_test(size=(100, 30)) as pilot:
        await started(app, pilot)
        before = fake.state_requests()
        await pilot.press("r")
        await wait_until(pilot, lambda: fake.state_requests() > before)


async def test_q_quits(fake: FakeAppliance) -> None:
    app = console(fake.url)
    async with app.run_test(size=(100, 30)) as pilot:
        await started(app, pilot)
        await pilot.press("q")
        await wait_until(pilot, lambda: app._exit)


# -- the connection ------------------------------------------------------------------------
async def test_a_lost_connection_shows_a_banner_and_recovers_by_itself(
    fake: FakeAppliance,
) -> None:
    app = console(fake.url)
    async with app.run_test(size=(120, 30)) as pilot:
        await started(app, pilot)
        await pilot.press("2")
        fake.down()
        await until_text(pilot, "⚠ connection lost: cannot reach")
        text = " ".join(screen_text(app).split())  # the banner may wrap
        assert "connection refused" in text
        assert "showing the snapshot of 00:00:00Z" in text
        assert "sess-000" in text, "the last snapshot stays on screen"
        assert isinstance(app.link, Lost)
        fake.set_state(make_state(tick=6))
        fake.up()
        await until_text(pilot, "00:00:03Z")
        await wait_until(pilot, lambda: "connection lost" not in screen_text(app))
        assert app.link == "ok"
        await pilot.press("1")  # every tab had the banner; none keeps it
        assert "connection lost" not in screen_text(app)


async def test_a_banner_before_any_snapshot_and_a_refused_key() -> None:
    fake = FakeAppliance(make_state()).up()
    try:
        app = console(fake.url, key="sk-not-an-operator")
        async with app.run_test(size=(120, 30)) as pilot:
            await until_text(pilot, "key refused: 401 Unauthorized: missing or unknown API key")
            text = " ".join(screen_text(app).split())
            assert "not retrying: r tries again · no snapshot yet" in text
            assert app.state is None
    finally:
        fake.down()


async def test_connecting_is_said_until_the_first_snapshot() -> None:
    fake = FakeAppliance(make_state()).up()
    gate: list[bool] = []
    fake.on_state = lambda: time.sleep(0.5) if not gate else None
    try:
        app = console(fake.url)
        async with app.run_test(size=(120, 30)) as pilot:
            await until_text(pilot, f"connecting to {fake.url} …")
            gate.append(True)
            await wait_until(pilot, lambda: app.state is not None)
            await wait_until(pilot, lambda: "connecting" not in screen_text(app))
    finally:
        fake.down()


async def test_queued_snapshots_coalesce_to_the_newest(fake: FakeAppliance) -> None:
    app = console(fake.url, interval_s=30.0)
    async with app.run_test(size=(100, 30)) as pilot:
        await started(app, pilot)
        before = app.updates
        states = [convert_state(make_state(tick=i)) for i in range(1, 41)]
        for state in states:  # all queued before the app gets to any of them
            app.post_message(StateUpdated(state))
        await pilot.pause(0.2)
        assert app.state is states[-1]
        assert app.updates - before < len(states) / 2
    assert StateUpdated(states[0]).can_replace(StateUpdated(states[1]))
