"""The terminal tables of `appliance status/sessions/tasks/costs`: pure text from a snapshot."""

from __future__ import annotations

import json
from typing import Any

import pytest
from msgspec import ValidationError

from appliance.services.operator.events import EventKind
from appliance.services.operator.session_admin import RELEASE_REASON, RELEASED
from appliance.services.residency.session_kv import NO_DECISION_REASON
from tests.tui.fakes import SIM_DRIVER, T0, make_state
from tui import format as fmt
from tui.tables import (
    json_view,
    render_costs,
    render_events,
    render_sessions,
    render_status,
    render_tasks,
)


def small_state() -> dict[str, Any]:
    return {
        "time": T0,
        "workers": [
            {
                "id": "w0",
                "engine": "vllm",
                "url": "http://127.0.0.1:8100",
                "gpus": [0],
                "restarts": 2,
                "healthy": True,
                "draining": False,
                "running": 3,
                "waiting": 1,
                "kv_usage": 0.5,
                "prefix_hit_rate": 0.25,
                "prefill_slowdown": 1.256,
            },
            {
                "id": "w1",
                "engine": "vllm",
                "url": "http://127.0.0.1:8101",
                "gpus": [1],
                "restarts": 0,
                "healthy": False,
                "draining": False,
                "running": None,
                "waiting": None,
                "kv_usage": None,
                "prefix_hit_rate": None,
            },
        ],
        "gpus": [
            {
                "index": 0,
                "name": "NVIDIA H200",
                "mem_total_bytes": 141 << 30,
                "mem_used_bytes": 100 << 30,
                "util": 0.9,
                "temp_c": 60.0,
                "power_w": 500.0,
            },
        ],
        "sessions": [
            {
                "id": "s-small",
                "tenant": "bob",
                "task_id": "kid",
                "worker": "w0",
                "resident_tokens": {"gpu": 10, "host": 0},
                "resident_bytes": {"gpu": 1280, "host": 0},
                "idle_s": 1.25,
                "turns": 1,
                "tool_class": None,
                "expected_wait_s": None,
                "decision": None,
                "reason": NO_DECISION_REASON,
            },
            {
                "id": "s-big",
                "tenant": "alice",
                "task_id": "root",
                "worker": "w0",
                "resident_tokens": {"gpu": 2048, "host": 512, "gpu_held": 1024, "gone": 64},
                "held_until": T0 + 30,
                "resident_bytes": {"gpu": 2048 * 1024, "host": 512 * 1024},
                "idle_s": 75.0,
                "turns": 4,
                "tool_class": "shell",
                "expected_wait_s": 3.0,
                "decision": RELEASED,
                "reason": RELEASE_REASON,
            },
        ],
        "tasks": [
            {
                "id": "root",
                "parent_id": None,
                "tenant": "alice",
                "task_class": "code",
                "status": "open",
                "deadline_at": T0 + 30,
                "tokens": 500,
                "cost": None,
                "children": ["kid", "kid2"],
                "kv_own_tokens": 4096,
                "kv_own_kept_tokens": 1024,
            },
            {
                "id": "kid",
                "parent_id": "root",
                "tenant": "alice",
                "task_class": None,
                "status": "succeeded",
                "deadline_at": T0 - 2,
                "tokens": 40,
                "cost": 0.25,
                "children": ["grandkid"],
                "kv_inherited_tokens": 4096,
                "kv_reclaimed_tokens": 640,
                "kv_reclaimed_at": T0 - 1,
            },
            {
                "id": "grandkid",
                "parent_id": "kid",
                "tenant": "alice",
                "task_class": None,
                "status": "failed",
                "deadline_at": None,
                "tokens": 1,
                "cost": None,
                "children": [],
            },
            {
                "id": "kid2",
                "parent_id": "root",
                "tenant": "alice",
                "task_class": None,
                "status": "open",
                "deadline_at": None,
                "tokens": 2,
                "cost": None,
                "children": [],
            },
        ],
        "costs": {},
        "admission": {},
        "routing": {},
    }


def test_status() -> None:
    assert render_status(small_state()) == "\n".join(
        [
            "appliance state at 00:00:00Z",
            "",
            "worker  engine  gpus  state  running  waiting   kv  prefix  prefill  restarts  wake",
            "w0      vllm    0     awake        3        1  50%     25%    x1.26         2     -",
            "w1      vllm    1     down         -        -    -       -    x1.00         0     -",
            "",
            "gpu  name         hbm used         kv GiB  util  temp  power",
            "0    NVIDIA H200  100.0/141.0 GiB  -        90%   60C   500W",
            "",
            "sessions: 2, resident on GPU 2,058 tokens (2.0 MiB)",
            "tasks: 4, 1 failed, 2 open, 1 succeeded",
        ]
    )


def test_status_shows_sleeping_waking_and_stopped_workers_by_their_state() -> None:
    state = small_state()
    resting = {"healthy": False, "running": None, "waiting": None}
    state["workers"] = [
        state["workers"][0] | {"last_wake_s": 2.5},
        {**state["workers"][1], **resting, "id": "w1", "state": "asleep", "sleep_level": 1},
        {**state["workers"][1], **resting, "id": "w2", "state": "waking", "last_wake_s": 41.0},
        {**state["workers"][1], **resting, "id": "w3", "state": "stopped", "lifecycle": "stopped"},
        {**state["workers"][0], **resting, "id": "w4", "draining": True},
    ]
    rows = [line.split() for line in render_status(state).splitlines()[3:8]]
    assert [(r[0], " ".join(r[3:-7])) for r in rows] == [
        ("w0", "awake"),
        ("w1", "asleep L1"),
        ("w2", "waking"),
        ("w3", "stopped"),
        ("w4", "draining"),
    ]
    assert [r[-1] for r in rows] == ["2.5s", "-", "41s", "-", "-"]
    assert "down" not in render_status(state)


def test_status_tells_a_worker_given_up_on_or_crashed_from_one_stopped_at_rest() -> None:
    state = small_state()
    gone = {"healthy": False, "running": None, "waiting": None, "state": "stopped"}
    state["workers"] = [
        {**state["workers"][0], **gone, "id": "w0", "lifecycle": "failed"},
        {**state["workers"][1], **gone, "id": "w1", "lifecycle": "exited"},
        {**state["workers"][1], **gone, "id": "w2", "lifecycle": "stopped"},
    ]
    rows = [line.split() for line in render_status(state).splitlines()[3:6]]
    assert [(r[0], r[3]) for r in rows] == [("w0", "failed"), ("w1", "down"), ("w2", "stopped")]


def test_status_without_gpus_or_workers() -> None:
    state = small_state() | {"gpus": [], "workers": []}
    text = render_status(state)
    assert "workers: none" in text
    assert "gpus: none reported (NVML sees no NVIDIA GPU on the appliance's host)" in text


def test_sessions_most_resident_first() -> None:
    lines = render_sessions(small_state()).splitlines()
    assert lines[0].split() == [
        "session",
        "tenant",
        "task",
        "worker",
        "gpu_tokens",
        "held_tokens",
        "held_until",
        "host_tokens",
        "gone_tokens",
        "gpu_bytes",
        "host_bytes",
        "idle",
        "turns",
        "tool",
        "wait",
        "decision",
        "reason",
    ]
    assert lines[1].split() == [
        "s-big",
        "alice",
        "root",
        "w0",
        "2048",
        "1024",
        "00:00:30Z",
        "512",
        "64",
        "2.0",
        "MiB",
        "512.0",
        "KiB",
        "1m15s",
        "4",
        "shell",
        "3.0s",
        RELEASED,
        *RELEASE_REASON.split(),
    ]
    assert lines[2].split()[0] == "s-small" and lines[2].endswith(NO_DECISION_REASON)
    assert render_sessions(small_state() | {"sessions": []}) == "no sessions"


def test_tasks_flat_and_as_a_tree() -> None:
    flat = render_tasks(small_state()).splitlines()
    assert [line.split()[:2] for line in flat[1:]] == [
        ["root", "-"],
        ["kid", "root"],
        ["grandkid", "kid"],
        ["kid2", "root"],
    ]
    assert render_tasks(small_state(), tree=True) == "\n".join(
        [
            "task            tenant  class  status     slack  tokens    cost"
            "  children  kv_inherited  kv_own  kv_own_kept  kv_reclaimed  reclaimed_at",
            "root            alice   code   open         30s     500       -"
            "         2             0    4096         1024             -  -",
            "├─ kid          alice   -      succeeded  -2.0s      40  0.2500"
            "         1          4096       0            0           640  23:59:59Z",
            "│  └─ grandkid  alice   -      failed         -       1       -"
            "         0             0       0            0             -  -",
            "└─ kid2         alice   -      open           -       2       -"
            "         0             0       0            0             -  -",
        ]
    )


def test_a_task_cycle_is_printed_once() -> None:
    state = small_state()
    state["tasks"][2]["children"] = ["root"]  # bad data must not loop forever
    assert render_tasks(state, tree=True).count("root") == 1


def test_status_says_when_the_gpus_are_simulated() -> None:
    assert SIM_DRIVER not in render_status(make_state())
    assert f"gpus: {SIM_DRIVER}" in render_status(make_state(simulated=True)).splitlines()


def test_events_newest_first_as_the_appliance_sends_them() -> None:
    state = small_state()
    assert render_events(state).startswith("events: not reported")
    state["events"] = []
    assert render_events(state) == "no events"
    state["events"] = [
        {
            "at": T0 - 1,
            "kind": EventKind.RELEASE,
            "subject": "s-big",
            "tenant": "alice",
            "detail": "released by operator",
        },
        {"at": T0 - 60, "kind": EventKind.WORKER_RESTART, "subject": "w1", "detail": "restarted"},
    ]
    lines = render_events(state).splitlines()
    assert lines[0].split() == ["time", "kind", "subject", "tenant", "detail"]
    assert lines[1].split()[:4] == ["23:59:59Z", "release", "s-big", "alice"]
    assert lines[2].split()[:4] == ["23:59:00Z", "worker_restart", "w1", "-"]
    assert json.loads(json_view(state, "events")) == {"events": state["events"]}


def test_costs_not_reported_and_reported() -> None:
    assert render_costs(small_state()).startswith("costs: not reported")
    state = small_state()
    state["costs"] = {"currency": "EUR", "groups": []}
    assert render_costs(state) == "costs: no finished tasks yet"
    state["costs"]["groups"] = [
        {
            "task_class": "code",
            "tenant": "alice",
            "tasks": 3,
            "succeeded": 2,
            "attempts": 9,
            "cost": 1.5,
            "overhead": 0.5,
            "total_cost": 2.0,
            "cost_per_success": 1.0,
        },
        {
            "task_class": "old",
            "tenant": "bob",
            "tasks": 1,
            "succeeded": 1,
            "attempts": 1,
            "cost": 0.5,
            "cost_per_success": 0.5,
        },  # from a server that spreads no overhead
    ]
    lines = render_costs(state).splitlines()
    assert lines[0].split()[5:8] == ["cost", "overhead", "total"]
    assert lines[1].split() == [
        "code",
        "alice",
        "3",
        "2",
        "9",
        "1.50",
        "0.5000",
        "2.00",
        "1.00",
        "EUR",
    ]
    assert lines[2].split()[5:9] == ["0.5000", "-", "-", "0.5000"]


def test_json_views() -> None:
    state = small_state()
    assert json.loads(json_view(state, "status")) == state
    assert json.loads(json_view(state, "sessions")) == {"sessions": state["sessions"]}
    assert json.loads(json_view(state, "tasks")) == {"tasks": state["tasks"]}
    assert json.loads(json_view(state, "costs")) == {}


def test_a_snapshot_of_another_shape_is_refused() -> None:
    state = small_state()
    del state["workers"][0]["healthy"]
    with pytest.raises(ValidationError):
        render_status(state)


@pytest.mark.parametrize(
    ("value", "text"),
    [(None, "-"), (0, "0"), (9999, "9999"), (12_345, "12.3k"), (1_572_600, "1.57M")],
)
def test_token_counts(value: int | None, text: str) -> None:
    assert fmt.tokens(value) == text


@pytest.mark.parametrize(
    ("value", "text"),
    [(None, "-"), (0.04, "0.0s"), (9.95, "9.9s"), (42.4, "42s"), (185, "3m05s"), (7440, "2h04m")],
)
def test_durations(value: float | None, text: str) -> None:
    assert fmt.seconds(value) == text


def test_sizes_and_percentages() -> None:
    assert [fmt.size(v) for v in (None, 0, 1023, 1024, 3 << 30)] == [
        "-",
        "0 B",
        "1023 B",
        "1.0 KiB",
        "3.0 GiB",
    ]
    assert fmt.pct(None) == "-" and fmt.pct(0.416) == "42%"
    assert fmt.clock(T0 + 3661) == "01:01:01Z"
