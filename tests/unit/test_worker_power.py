"""Worker power as tables: which idle workers sleep or stop (`decide_power`), the state
they go to, which worker a turn wakes (`choose_wake`) and what admission adds for it."""

from __future__ import annotations

import math

import pytest

from appliance.policy.worker_power import (
    ALL_STATES,
    ASLEEP_GPU_BYTES,
    CPU_VLLM_STATES,
    WAKING,
    PowerAction,
    PowerKind,
    PowerSettings,
    PowerState,
    PowerTable,
    StateFigures,
    WakeKind,
    WorkerPower,
    choose_wake,
    decide_power,
    power_table,
    sleep_target,
    wake_delay_s,
)
from tests.cases import case

A, S1, S2, ST = (
    PowerState.AWAKE,
    PowerState.ASLEEP_1,
    PowerState.ASLEEP_2,
    PowerState.STOPPED,
)
GIB = 1 << 30
FIGURES = {
    A: StateFigures(0.0, gpu_bytes=130 * GIB),
    S1: StateFigures(2.0, gpu_bytes=1 * GIB, host_bytes=16 * GIB),
    S2: StateFigures(20.0, gpu_bytes=1 * GIB),
    ST: StateFigures(60.0),
}
TABLE = PowerTable(FIGURES)
CPU = PowerTable(FIGURES, supported=CPU_VLLM_STATES)


def worker(
    wid: str = "w0", state: PowerState = A, idle_s: float = 100.0, **kw: object
) -> WorkerPower:
    return WorkerPower(wid, str(kw.pop("model", "m")), state, idle_s, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("w", "settings", "table", "target", "kind", "action", "reason"),
    [
        # the idle threshold, either side and exactly at it
        case(
            (worker(idle_s=59.9), PowerSettings(60.0), TABLE),
            (A, PowerKind.IDLE_TOO_SHORT, PowerAction.STAY, "idle 59.9 s of 60 s"),
        ),
        case(
            (worker(idle_s=60.0), PowerSettings(60.0), TABLE),
            (
                ST,
                PowerKind.CHEAPEST_FIT,
                PowerAction.STOP,
                "idle 60 s >= 60 s: stopped is the cheapest state that wakes within inf s (60 s)",
            ),
        ),
        # the wake limit: exactly a state's wake time fits it, a hair under does not
        case(
            (worker(), PowerSettings(60.0, max_wake_s=60.0), TABLE),
            (ST, PowerKind.CHEAPEST_FIT, PowerAction.STOP, "within 60 s (60 s)"),
        ),
        case(
            (worker(), PowerSettings(60.0, max_wake_s=59.9), TABLE),
            (
                S2,
                PowerKind.CHEAPEST_FIT,
                PowerAction.SLEEP,
                "asleep-2 is the cheapest state that wakes within 59.9 s (20 s)",
            ),
        ),
        case(
            (worker(), PowerSettings(60.0, max_wake_s=20.0), TABLE),
            (S2, PowerKind.CHEAPEST_FIT, PowerAction.SLEEP, "(20 s)"),
        ),
        case(
            (worker(), PowerSettings(60.0, max_wake_s=19.0), TABLE),
            (
                S1,
                PowerKind.CHEAPEST_FIT,
                PowerAction.SLEEP,
                "asleep-1 is the cheapest state that wakes within 19 s (2 s)",
            ),
        ),
        case(
            (worker(), PowerSettings(60.0, max_wake_s=1.9), TABLE),
            (A, PowerKind.NO_STATE_FITS, PowerAction.STAY, "no supported state wakes within 1.9 s"),
        ),
        # unsupported states are never chosen: the CPU build only stops
        case(
            (worker(), PowerSettings(60.0, max_wake_s=30.0), CPU),
            (A, PowerKind.NO_STATE_FITS, PowerAction.STAY, "within 30 s"),
        ),
        case(
            (worker(), PowerSettings(60.0), CPU),
            (ST, PowerKind.CHEAPEST_FIT, PowerAction.STOP, "stopped"),
        ),
        # a worker with work, or not awake, stays as it is
        case(
            (worker(running=1), PowerSettings(0.0), TABLE),
            (A, PowerKind.BUSY, PowerAction.STAY, "busy: 1 running, 0 waiting, 0 held"),
        ),
        case(
            (worker(waiting=2), PowerSettings(0.0), TABLE),
            (A, PowerKind.BUSY, PowerAction.STAY, "busy: 0 running, 2 waiting, 0 held"),
        ),
        case(
            (worker(held=3), PowerSettings(0.0), TABLE),
            (A, PowerKind.BUSY, PowerAction.STAY, "busy: 0 running, 0 waiting, 3 held"),
        ),
        case(
            (worker(state=S1), PowerSettings(0.0), TABLE),
            (S1, PowerKind.NOT_AWAKE, PowerAction.STAY, "asleep: nothing to decide"),
        ),
        case(
            (worker(state=ST), PowerSettings(0.0), TABLE),
            (ST, PowerKind.NOT_AWAKE, PowerAction.STAY, "stopped: nothing to decide"),
        ),
        case(
            (worker(state=S2, waking_left_s=3.0), PowerSettings(0.0), TABLE),
            (S2, PowerKind.NOT_AWAKE, PowerAction.STAY, "waking: nothing to decide"),
        ),
        case(
            (worker(idle_s=1e9), PowerSettings(None), TABLE),
            (A, PowerKind.DISABLED, PowerAction.STAY, "no worker_idle_s: always awake"),
        ),
        case(
            (worker(idle_s=0.0), PowerSettings(0.0), TABLE),
            (ST, PowerKind.CHEAPEST_FIT, PowerAction.STOP, "idle 0 s >= 0 s"),
        ),
    ],
)
def test_one_worker(
    w: WorkerPower,
    settings: PowerSettings,
    table: PowerTable,
    target: PowerState,
    kind: PowerKind,
    action: PowerAction,
    reason: str,
) -> None:
    (d,) = decide_power([w], settings, table)
    assert (d.worker_id, d.target, d.kind, d.action) == (w.worker_id, target, kind, action)
    assert reason in d.reason
    assert (d.idle_s, d.worker_idle_s, d.max_wake_s) == (
        w.idle_s,
        settings.worker_idle_s,
        settings.max_wake_s,
    )
    assert d.wake_s == (table.wake_s(target) if kind is PowerKind.CHEAPEST_FIT else 0.0)


def test_idle_too_short_says_when_to_look_again() -> None:
    (d,) = decide_power([worker(idle_s=45.5)], PowerSettings(60.0), TABLE)
    assert d.recheck_in_s == 14.5
    (gone,) = decide_power([worker(idle_s=61.0)], PowerSettings(60.0), TABLE)
    assert gone.recheck_in_s is None


@pytest.mark.parametrize(
    ("workers", "min_awake", "stopped"),
    [
        # none kept: every idle worker stops
        ([worker("a"), worker("b")], 0, {"a", "b"}),
        # one kept: the one idle the shortest (warmest cache)
        ([worker("a", idle_s=300.0), worker("b", idle_s=100.0)], 1, {"a"}),
        ([worker("a", idle_s=100.0), worker("b", idle_s=300.0)], 1, {"b"}),
        # ties by id
        ([worker("b"), worker("a")], 1, {"b"}),
        # a busy worker already counts as awake
        ([worker("a", running=1), worker("b")], 1, {"b"}),
        # so does a worker idle not long enough, and one waking
        ([worker("a", idle_s=5.0), worker("b")], 1, {"b"}),
        ([worker("a", state=ST, waking_left_s=9.0), worker("b")], 1, {"b"}),
        # ... whatever its idle time says
        ([worker("a", running=1, idle_s=300.0), worker("b")], 1, {"b"}),
        ([worker("a", state=ST, waking_left_s=9.0, idle_s=300.0), worker("b")], 1, {"b"}),
        # idle exactly the threshold: a candidate, kept (ties by id)
        ([worker("a", idle_s=60.0), worker("b", idle_s=60.0)], 1, {"b"}),
        # an asleep worker does not
        ([worker("a", state=S1), worker("b")], 1, set()),
        # min_awake above the count keeps them all
        ([worker("a"), worker("b")], 3, set()),
        ([worker("a"), worker("b"), worker("c", idle_s=50.0)], 2, {"b"}),
        # per model
        ([worker("a", model="x"), worker("b", model="y")], 1, set()),
        ([worker("a", model="x"), worker("b", model="x"), worker("c", model="y")], 1, {"b"}),
    ],
)
def test_min_awake(workers: list[WorkerPower], min_awake: int, stopped: set[str]) -> None:
    decisions = decide_power(workers, PowerSettings(60.0, min_awake=min_awake), TABLE)
    assert [d.worker_id for d in decisions] == [w.worker_id for w in workers]
    assert {d.worker_id for d in decisions if d.action is PowerAction.STOP} == stopped
    idle = {w.worker_id for w in workers if w.state is A and not w.busy and w.idle_s >= 60.0}
    kept = [d for d in decisions if d.kind is PowerKind.MIN_AWAKE]
    assert {d.worker_id for d in kept} == idle - stopped
    assert all(d.target is A and d.reason == f"kept awake: min_awake {min_awake}" for d in kept)


@pytest.mark.parametrize(
    ("figures", "max_wake_s", "expected"),
    [
        (FIGURES, math.inf, ST),
        (FIGURES, 0.0, None),
        # equal memory: the faster wake
        ({A: FIGURES[A], S2: StateFigures(9.0, 5), ST: StateFigures(8.0, 5)}, 10.0, ST),
        ({A: FIGURES[A], S2: StateFigures(8.0, 5), ST: StateFigures(9.0, 5)}, 10.0, S2),
        # less GPU memory first, then less host memory
        ({A: FIGURES[A], S1: StateFigures(1.0, 4, 9), S2: StateFigures(5.0, 5, 0)}, 10.0, S1),
        ({A: FIGURES[A], S1: StateFigures(1.0, 5, 9), S2: StateFigures(5.0, 5, 0)}, 10.0, S2),
        ({A: FIGURES[A], S1: StateFigures(1.0, 5, 1), S2: StateFigures(1.0, 5, 2)}, 10.0, S1),
        # all equal: the shallower state (enum order)
        ({A: FIGURES[A], S1: StateFigures(1.0), S2: StateFigures(1.0)}, 10.0, S1),
    ],
)
def test_sleep_target(
    figures: dict[PowerState, StateFigures], max_wake_s: float, expected: PowerState | None
) -> None:
    table = PowerTable(figures, supported=frozenset(figures))
    assert sleep_target(max_wake_s, table) is expected


@pytest.mark.parametrize(
    ("workers", "kind", "worker_id", "added_s", "from_state", "reason"),
    [
        case(
            [worker("a", state=A), worker("b", state=ST)],
            (WakeKind.AWAKE, None, 0.0, None, "a worker of m is awake"),
        ),
        # every awake worker saturated: the fastest resting one wakes, the turn does not wait
        case(
            [worker("a", state=A, waiting=1), worker("c", state=ST), worker("b", state=S2)],
            (
                WakeKind.MORE,
                "b",
                0.0,
                S2,
                "all 1 awake workers have turns waiting: wakes b from asleep-2 (20 s)",
            ),
        ),
        case(
            [worker("a", state=A, waiting=1), worker("b", state=ST), worker("c", state=ST)],
            (WakeKind.MORE, "b", 0.0, ST, "wakes b from stopped (60 s)"),
        ),
        # ... unless one has room, one is waking already, or none rests
        case(
            [worker("a", state=A, waiting=1), worker("d", state=A), worker("b", state=ST)],
            (WakeKind.AWAKE, None, 0.0, None, "awake"),
        ),
        case(
            [
                worker("a", state=A, waiting=1),
                worker("b", state=ST, waking_left_s=5.0),
                worker("c", state=ST),
            ],
            (WakeKind.AWAKE, None, 0.0, None, "awake"),
        ),
        case([worker("a", state=A, waiting=1)], (WakeKind.AWAKE, None, 0.0, None, "awake")),
        # the fastest to wake, whatever the order given
        case(
            [worker("a", state=ST), worker("b", state=S1), worker("c", state=S2)],
            (WakeKind.WAKE, "b", 2.0, S1, "wakes b from asleep-1: 2 s"),
        ),
        case(
            [worker("a", state=S2), worker("b", state=ST)],
            (WakeKind.WAKE, "a", 20.0, S2, "wakes a from asleep-2: 20 s"),
        ),
        # ties by id
        case([worker("b", state=S2), worker("a", state=S2)], (WakeKind.WAKE, "a", 20.0, S2, "a")),
        # one waking: the turn waits for it, even when another would wake faster
        case(
            [worker("a", state=S1), worker("b", state=ST, waking_left_s=30.0)],
            (WakeKind.WAIT, "b", 30.0, ST, "waits 30 s for b"),
        ),
        case(
            [worker("a", state=ST, waking_left_s=7.0), worker("b", state=S2, waking_left_s=4.0)],
            (WakeKind.WAIT, "b", 4.0, S2, "waits 4 s for b"),
        ),
        case(
            [worker("b", state=ST, waking_left_s=4.0), worker("a", state=ST, waking_left_s=4.0)],
            (WakeKind.WAIT, "a", 4.0, ST, "for a"),
        ),
        # waking just now done (0 s left)
        case(
            [worker("a", state=ST, waking_left_s=0.0)], (WakeKind.WAIT, "a", 0.0, ST, "waits 0 s")
        ),
        # workers of another model do not count
        case(
            [worker("a", state=A, model="x"), worker("b", state=ST)],
            (WakeKind.WAKE, "b", 60.0, ST, "wakes b"),
        ),
        case(
            [worker("a", state=A, model="x")],
            (WakeKind.NO_WORKER, None, 0.0, None, "no worker serves m"),
        ),
    ],
)
def test_choose_wake(
    workers: list[WorkerPower],
    kind: WakeKind,
    worker_id: str | None,
    added_s: float,
    from_state: PowerState | None,
    reason: str,
) -> None:
    choice = choose_wake("m", workers, TABLE)
    assert (choice.kind, choice.worker_id, choice.added_s, choice.from_state) == (
        kind,
        worker_id,
        added_s,
        from_state,
    )
    assert reason in choice.reason
    assert wake_delay_s("m", workers, TABLE) == added_s


def test_a_wake_from_an_unsupported_state_is_refused() -> None:
    with pytest.raises(ValueError, match="asleep-1 is not supported"):
        choose_wake("m", [worker(state=S1)], CPU)


@pytest.mark.parametrize(
    ("w", "shown"),
    [
        (worker(state=A), "awake"),
        (worker(state=S1), "asleep"),
        (worker(state=S2), "asleep"),
        (worker(state=ST), "stopped"),
        (worker(state=ST, waking_left_s=1.0), WAKING),
    ],
)
def test_shown_state(w: WorkerPower, shown: str) -> None:
    assert w.shown_state == shown


def test_sleep_levels_and_platforms() -> None:
    assert [s.sleep_level for s in PowerState] == [None, 1, 2, None]
    assert {A, S1, S2, ST} == ALL_STATES
    assert {A, ST} == CPU_VLLM_STATES
    assert WAKING == "waking"


@pytest.mark.parametrize(
    "build",
    [
        lambda: StateFigures(-1.0),
        lambda: StateFigures(math.nan),
        lambda: StateFigures(1.0, gpu_bytes=-1),
        lambda: StateFigures(1.0, host_bytes=-1),
        lambda: PowerTable({ST: StateFigures(1.0)}, supported=frozenset({ST})),
        lambda: PowerTable({A: StateFigures(0.0)}, supported=frozenset({A, S1, ST})),
        lambda: PowerSettings(-1.0),
        lambda: PowerSettings(math.nan),
        lambda: PowerSettings(1.0, max_wake_s=-1.0),
        lambda: PowerSettings(1.0, max_wake_s=math.nan),
        lambda: PowerSettings(1.0, min_awake=-1),
        lambda: WorkerPower("w", "m", A, waking_left_s=1.0),
        lambda: WorkerPower("w", "m", ST, waking_left_s=-0.5),
    ],
)
def test_bad_values_are_refused(build: object) -> None:
    with pytest.raises(ValueError):
        build()  # type: ignore[operator]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: PowerTable({A: StateFigures(0.0)}, supported=frozenset({A, S1, ST})),
            "no figures for supported states: asleep-1, stopped",
        ),
        (
            lambda: PowerTable({ST: StateFigures(1.0)}, supported=frozenset({ST})),
            "a platform that supports no awake state serves nothing",
        ),
        (lambda: PowerSettings(-1.0), "worker_idle_s must not be negative, got -1.0"),
        (lambda: PowerSettings(1.0, min_awake=-1), "max_wake_s and min_awake must not be negative"),
        (
            lambda: WorkerPower("w", "m", A, waking_left_s=1.0),
            "worker w: only a resting worker wakes, in >= 0 s",
        ),
        (
            lambda: StateFigures(-1.0),
            "state figures must not be negative: StateFigures(wake_s=-1.0, gpu_bytes=0, "
            "host_bytes=0)",
        ),
    ],
)
def test_bad_values_say_what(build: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        build()  # type: ignore[operator]
    assert str(info.value) == message


def test_reasons_in_full() -> None:
    settings = PowerSettings(60.0, max_wake_s=30.0)
    (d,) = decide_power([worker(idle_s=90.0)], settings, TABLE)
    assert d.reason == (
        "idle 90 s >= 60 s: asleep-2 is the cheapest state that wakes within 30 s (20 s)"
    )
    (off,) = decide_power([worker()], PowerSettings(None), TABLE)
    assert off.reason == "no worker_idle_s: always awake"
    assert choose_wake("m", [worker(state=ST)], TABLE).reason == "wakes w0 from stopped: 60 s"


def test_edge_values_are_accepted() -> None:
    assert StateFigures(0.0, 0, 0).wake_s == 0.0
    assert PowerSettings(0.0, max_wake_s=0.0, min_awake=0).worker_idle_s == 0.0
    assert WorkerPower("w", "m", ST, waking_left_s=0.0).busy is False
    assert PowerTable(FIGURES, supported=CPU_VLLM_STATES).supported == CPU_VLLM_STATES
    assert PowerSettings().worker_idle_s is None
    assert PowerSettings().max_wake_s == math.inf
    assert PowerSettings().min_awake == 0


def test_the_table_from_wake_times_holds_what_each_state_keeps() -> None:
    table = power_table((0.3, 2.7, 42.7), 16, 8, CPU_VLLM_STATES)
    assert table.supported == CPU_VLLM_STATES
    assert table.figures[PowerState.AWAKE] == StateFigures(0.0, 24)
    assert table.figures[PowerState.ASLEEP_1] == StateFigures(0.3, ASLEEP_GPU_BYTES, 16)
    assert table.figures[PowerState.ASLEEP_2] == StateFigures(2.7, ASLEEP_GPU_BYTES)
    assert table.figures[PowerState.STOPPED] == StateFigures(42.7)
    assert power_table((0.3, 2.7, 42.7), 16, 8).supported == ALL_STATES
