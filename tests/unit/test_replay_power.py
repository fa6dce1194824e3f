"""Scale to zero in the replay: idle workers stop or sleep, a turn wakes one (the wake in its
TTFT, one wake for every turn that arrives during it), a sleep releases held sessions, and
the report prices awake time against the always-awake row."""

from __future__ import annotations

import math

import pytest

from appliance.perf.profile import bundled_profile
from appliance.replay import render_table, run_workload
from appliance.replay.power import ReaperSetting, parse_worker_reaper
from appliance.replay.runner import make_setup
from appliance.replay.workload_replay import WorkloadRun, replay_closed_loop
from appliance.workload import AgentTask, AgentTurn

WAKE = bundled_profile().wake
assert WAKE is not None
STOPPED_S, ASLEEP_2_S = WAKE.stopped.seconds, WAKE.asleep_2.seconds


def task(task_id: str, start: float, *turns: AgentTurn) -> AgentTask:
    return AgentTask(
        task_id,
        None,
        "acme",
        "fix",
        start,
        None,
        True,
        True,
        "fix/0",
        1024,
        turns or (AgentTurn(256, 8, None, 0.0),),
    )


def run(
    tasks: list[AgentTask], setting: ReaperSetting, *, workers: int = 2, residency: str = "lru"
) -> WorkloadRun:
    setup, latency = make_setup(workers=workers, hbm_gib=4.0)
    return replay_closed_loop(
        tasks, "appliance", setup, latency, residency=residency, reaper=setting
    )


def ttft(run_: WorkloadRun) -> dict[str, float]:
    return {r.request_id: r.ttft_s for r in run_.result.records if r.ttft_s is not None}


@pytest.mark.parametrize(
    ("text", "setting", "label"),
    [
        ("60", ReaperSetting(60.0), "60"),
        ("60:5", ReaperSetting(60.0, 5.0), "60:5"),
        ("0.5:2.7:1", ReaperSetting(0.5, 2.7, 1), "0.5:2.7:1"),
        ("60::1", ReaperSetting(60.0, math.inf, 1), "60:inf:1"),
    ],
)
def test_settings_by_text(text: str, setting: ReaperSetting, label: str) -> None:
    assert parse_worker_reaper(text) == setting
    assert setting.label == label
    assert ReaperSetting().label == "always-awake"


@pytest.mark.parametrize("text", ["", "x", "60:5:1:2", "-1", "60:-5", "60:5:-1", "60:5:1.5"])
def test_bad_settings_name_the_form(text: str) -> None:
    with pytest.raises(ValueError, match=r"IDLE_S\[:MAX_WAKE_S\[:MIN_AWAKE\]\]"):
        parse_worker_reaper(text)


def test_an_idle_gap_stops_the_workers_and_the_next_turn_waits_for_one_wake() -> None:
    tasks = [task("a", 0.0), task("b", 500.0), task("c", 510.0), task("d", 1000.0)]
    awake = run(tasks, ReaperSetting())
    lazy = run(tasks, ReaperSetting(60.0))
    base, woken = ttft(awake), ttft(lazy)
    assert base["a/0"] == pytest.approx(woken["a/0"])  # all awake at the start
    assert woken["b/0"] == pytest.approx(base["b/0"] + STOPPED_S, abs=0.05)  # b wakes one
    assert woken["c/0"] == pytest.approx(500.0 + STOPPED_S - 510.0 + base["c/0"], abs=0.1)
    assert woken["d/0"] == pytest.approx(base["d/0"] + STOPPED_S, abs=0.05)
    assert lazy.power is not None and awake.power is not None
    end = lazy.result.end_s
    figures = lazy.power.summary(end)
    assert figures["wakes"] == 2  # b's (c waits for it) and d's
    assert figures["waited_turns"] == 3
    # both at 60 s, b's worker 60 s after b; d's ends the replay awake
    assert figures["sleeps"] == {"stopped": 2 + 1}
    stopped_s = float(figures["stopped_gpu_h"]) * 3600  # type: ignore[arg-type]
    assert stopped_s == pytest.approx(2 * end - float(figures["awake_gpu_s"]), abs=0.1)  # type: ignore[arg-type]
    always = awake.power.summary(awake.result.end_s)
    assert always["awake_gpu_s"] == pytest.approx(2 * awake.result.end_s, abs=0.01)
    assert (always["wakes"], always["sleeps"]) == (0, {})


def test_the_wake_limit_picks_a_sleep_and_min_awake_keeps_one_up() -> None:
    tasks = [task("a", 0.0), task("b", 500.0)]
    asleep = run(tasks, ReaperSetting(60.0, max_wake_s=5.0))
    assert asleep.power is not None
    assert asleep.power.summary(asleep.result.end_s)["sleeps"] == {"asleep-2": 2}
    assert ttft(asleep)["b/0"] == pytest.approx(
        ttft(run(tasks, ReaperSetting()))["b/0"] + ASLEEP_2_S, abs=0.05
    )
    kept = run(tasks, ReaperSetting(60.0, min_awake=1))
    assert kept.power is not None
    figures = kept.power.summary(kept.result.end_s)
    assert (figures["wakes"], figures["sleeps"]) == (0, {"stopped": 1})
    assert ttft(kept)["b/0"] < 1.0


def test_a_sleep_releases_the_sessions_a_worker_holds() -> None:
    wait = AgentTurn(2048, 8, "human", 400.0)
    tasks = [task("a", 0.0, wait, AgentTurn(64, 8, None, 0.0))]
    held = run(tasks, ReaperSetting(60.0), workers=1, residency="ttl-pin:1000")
    assert held.power is not None
    assert held.power.summary(held.result.end_s)["released_sessions"] == 1
    kept = run(tasks, ReaperSetting(), workers=1, residency="ttl-pin:1000")
    assert {r.request_id: r.cached_tokens for r in kept.result.records}["a/1"] > 2048
    assert {r.request_id: r.cached_tokens for r in held.result.records}["a/1"] == 0


def test_the_report_prices_awake_time_against_the_always_awake_row() -> None:
    tasks = [task("a", 0.0), task("b", 500.0)]
    report = run_workload(
        tasks, policies=["appliance"], workers=2, hbm_gib=4.0, worker_reapers=["60", "60:5"]
    )
    rows = report["policies"]
    assert list(rows) == ["appliance", "appliance+worker-reaper:60", "appliance+worker-reaper:60:5"]
    base, stop = rows["appliance"]["power"], rows["appliance+worker-reaper:60"]["power"]
    assert base["setting"] == "always-awake" and base["added_ttft_p95_s"] is None
    assert stop["added_ttft_p95_s"] == pytest.approx(
        rows["appliance+worker-reaper:60"]["ttft_p95_s"] - rows["appliance"]["ttft_p95_s"],
        abs=1e-3,
    )
    assert stop["added_ttft_p95_s"] > STOPPED_S - 1
    assert stop["awake_cost_per_success"] < base["awake_cost_per_success"]
    assert base["awake_cost_per_success"] == pytest.approx(
        base["awake_gpu_s"] * 0.0011 / 2, rel=1e-6
    )
    table = render_table(report)
    assert "appliance+worker-reaper:60: " in table and "wakes" in table
    assert "TTFT p95 - vs always awake" in table


def test_without_a_setting_no_row_watches_power() -> None:
    report = run_workload([task("a", 0.0)], policies=["appliance"], workers=1, hbm_gib=4.0)
    assert report["policies"]["appliance"]["power"] is None
