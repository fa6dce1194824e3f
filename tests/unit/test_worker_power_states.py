"""The lifecycle with scale to zero: asleep, stopped and waking fit the old moves, and each
state has one coarse power view."""

from __future__ import annotations

from appliance.domain.worker import (
    TRANSITIONS,
    WorkerPowerState,
    WorkerState,
    accepts_requests,
    can_move,
    can_serve,
    power_state,
)
from appliance.sim.entrypoints.vllm_entry import worker_config


def test_every_state_has_its_moves_and_a_power_view() -> None:
    assert set(TRANSITIONS) == set(WorkerState)
    views = {s: power_state(s) for s in WorkerState}
    assert views[WorkerState.HEALTHY] == WorkerPowerState.AWAKE
    assert views[WorkerState.ASLEEP] == WorkerPowerState.ASLEEP
    assert views[WorkerState.STOPPED] == WorkerPowerState.STOPPED
    assert views[WorkerState.WAKING] == WorkerPowerState.WAKING
    assert [s for s in WorkerState if accepts_requests(s)] == [WorkerState.HEALTHY]


def test_sleep_stop_and_wake_moves() -> None:
    assert can_move(WorkerState.HEALTHY, WorkerState.ASLEEP)
    assert can_move(WorkerState.ASLEEP, WorkerState.WAKING)
    assert can_move(WorkerState.STOPPED, WorkerState.WAKING)
    assert can_move(WorkerState.WAKING, WorkerState.HEALTHY)
    assert can_move(WorkerState.WAKING, WorkerState.STOPPED)  # a start that failed
    # A stopped worker comes back only through a wake, never by the crash path's restart,
    # and only a healthy worker is put to sleep.
    assert not can_move(WorkerState.STOPPED, WorkerState.STARTING)
    assert not can_move(WorkerState.UNHEALTHY, WorkerState.ASLEEP)
    assert not can_move(WorkerState.EXITED, WorkerState.STOPPED)


def test_a_worker_at_rest_can_serve_a_crashed_or_shut_down_one_cannot() -> None:
    serving = {s for s in WorkerState if can_serve(s, draining=False)}
    assert serving == {
        WorkerState.HEALTHY,
        WorkerState.ASLEEP,
        WorkerState.STOPPED,
        WorkerState.WAKING,
    }
    # At shutdown every worker drains and ends STOPPED: that is no rest.
    assert not any(can_serve(s, draining=True) for s in WorkerState)


def test_the_sim_reads_vllms_command_line() -> None:
    events = '{"enable_kv_cache_events":true,"endpoint":"tcp://127.0.0.1:5","topic":"t"}'
    argv = [
        "--model",
        "m",
        "--port",
        "9",
        "--block-size",
        "32",
        "--kv-events-config",
        events,
        "--enable-sleep-mode",
        "--scheduling-policy",
        "priority",
        "--sim-wake-s",
        "0.5,2",
    ]
    config = worker_config(argv, {"VLLM_SERVER_DEV_MODE": "1", "PYTHONHASHSEED": "0"})
    assert (config.port, config.block_size, config.scheduling_policy) == (9, 32, "priority")
    assert (config.kv_events_endpoint, config.kv_events_topic) == ("tcp://127.0.0.1:5", "t")
    assert (config.dev_mode, config.wake_s, config.python_hash_seed) == (True, (0.5, 2.0), "0")
    assert not worker_config(["--model", "m"], {}).dev_mode
