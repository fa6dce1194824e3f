"""Per-row replay figures on tiny hand-made inputs, each expected value computed by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from appliance.replay.closed_loop import GpuSeconds, TaskOutcome
from appliance.replay.metrics import TASK_KEYS, policy_metrics, task_metrics
from appliance.replay.report import render_table
from appliance.sim.core.engine_stats import EngineStats
from appliance.sim.engine_io import StepResult
from appliance.sim.runtime.virtual import ReplayResult, RequestRecord


def stats(busy_s: float, preemptions: int, **kw: int) -> EngineStats:
    return EngineStats(
        num_running=0,
        num_waiting=0,
        kv_cache_usage=0.0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        prompt_tokens_total=0,
        prompt_tokens_by_source={},
        generation_tokens_total=0,
        num_preemptions_total=preemptions,
        request_success_total={},
        busy_s_total=busy_s,
        **kw,
    )


def rec(
    rid: str, worker: int, arrival: float, prompt: int, cached: int, finish: float
) -> RequestRecord:
    return RequestRecord(rid, worker, arrival, prompt, arrival + 0.5, finish, cached, 1, "length")


@pytest.fixture
def metrics() -> dict[str, object]:
    records = [
        rec("r1", 0, 0.0, 1000, 200, 2.0),  # session S1
        rec("r2", 1, 1.0, 600, 0, 4.0),  # S1
        rec("r3", 1, 2.0, 400, 100, 3.0),  # S2
        rec("r4", 0, 5.0, 200, 0, 12.0),  # S3
    ]
    engines = [
        stats(3.0, 2, pins_total=3, pins_expired_total=1, pins_reclaimed_total=1),
        stats(1.0, 1, pins_total=2, pins_resumed_total=2),
    ]
    result = ReplayResult(records, engines, end_s=12.0)
    sessions = {"r1": "S1", "r2": "S1", "r3": "S2", "r4": "S3"}
    return policy_metrics(result, sessions, optimal_fresh=1000, workers=2)


def test_session_completion_times(metrics: dict[str, object]) -> None:
    # S1: 4.0 - 0.0, S2: 3.0 - 2.0, S3: 12.0 - 5.0 -> [1, 4, 7]; nearest rank.
    assert metrics["sessions"] == 3
    assert metrics["session_p50_s"] == 4.0 and metrics["session_p95_s"] == 7.0


def test_load_imbalance(metrics: dict[str, object]) -> None:
    assert metrics["imbalance"] == pytest.approx(3.0 / 2.0)  # busy seconds 3 and 1
    assert metrics["requests_imbalance"] == 1.0  # two requests each
    # fresh prefill: worker 0 800 + 200, worker 1 600 + 300 -> 1000 / 950
    assert metrics["prefill_imbalance"] == pytest.approx(1000 / 950, abs=1e-4)
    assert metrics["fresh_prefill_tokens"] == 1900 and metrics["vs_optimal"] == 1.9


def test_preemptions_and_pins(metrics: dict[str, object]) -> None:
    assert metrics["preemptions"] == 3
    assert (metrics["pins"], metrics["pins_expired"], metrics["pins_resumed"]) == (5, 1, 2)
    assert metrics["pins_reclaimed"] == 1


def test_a_trace_has_no_task_figures(metrics: dict[str, object]) -> None:
    assert all(metrics[k] is None for k in TASK_KEYS)


def outcome(
    task_id: str,
    *,
    start: float,
    finish: float | None,
    deadline: float | None,
    gpu_s: float,
    done: int = 2,
    parent: str | None = None,
    succeeds: bool = True,
    verified: bool = True,
    discarded: bool = False,
) -> TaskOutcome:
    return TaskOutcome(
        task_id,
        parent,
        "acme",
        "fix",
        start,
        deadline,
        2,
        done,
        finish,
        succeeds,
        verified,
        gpu_s,
        discarded=discarded,
    )


def test_deadline_goodput_and_cost_per_success() -> None:
    outcomes = [
        outcome("t1", start=0.0, finish=10.0, deadline=12.0, gpu_s=2.0),  # met, success
        outcome("t2", start=5.0, finish=20.0, deadline=10.0, gpu_s=3.0, verified=False),
        outcome("t3", start=1.0, finish=3.0, deadline=None, gpu_s=1.0),  # success
        outcome("t4", start=2.0, finish=4.0, deadline=50.0, gpu_s=4.0, done=1),  # unfinished
        outcome("t1.0", start=3.0, finish=6.0, deadline=None, gpu_s=2.0, parent="t1"),
    ]
    m = task_metrics(outcomes, gpu_second=0.5)
    assert m["tasks"] == 5 and m["tasks_completed"] == 4
    assert m["deadline_goodput"] == pytest.approx(1 / 3, abs=1e-6)  # t1 of t1, t2, t4
    assert m["gpu_s"] == 12.0
    # 12 GPU-seconds at 0.5 (the child rolls into t1) over the verified root successes t1, t3.
    assert m["cost_per_success"] == 3.0


def test_discarded_branches_and_their_share_of_the_attempted_cost() -> None:
    """r keeps r.0's result and drops r.1's (with r.1's own child): 3 + 0.5 of the 8
    GPU-seconds went into branches nobody used, whatever the price per GPU-second."""
    outcomes = [
        outcome("r", start=0.0, finish=9.0, deadline=None, gpu_s=2.0),
        outcome("r.0", start=1.0, finish=4.0, deadline=None, gpu_s=1.0, parent="r"),
        outcome("r.1", start=1.0, finish=5.0, deadline=None, gpu_s=3.0, parent="r", discarded=True),
        outcome(
            "r.1.0", start=2.0, finish=3.0, deadline=None, gpu_s=0.5, parent="r.1", discarded=True
        ),
        outcome("s", start=0.5, finish=2.0, deadline=None, gpu_s=1.5),
    ]
    for price in (0.5, 3.0):
        m = task_metrics(outcomes, gpu_second=price)
        assert (m["discarded_branches"], m["discarded_cost_share"]) == (2, 0.4375)
        # Cost per success counts them still: 8 GPU-seconds over the successes r and s.
        assert m["cost_per_success"] == 4 * price
    kept = [replace(o, discarded=False) for o in outcomes]
    m = task_metrics(kept, gpu_second=0.5)
    assert (m["discarded_branches"], m["discarded_cost_share"]) == (0, 0.0)
    m = task_metrics([replace(o, gpu_s=0.0) for o in outcomes], gpu_second=0.5)
    assert (m["discarded_branches"], m["discarded_cost_share"]) == (2, None)  # nothing spent


def test_the_table_names_each_rows_discarded_branches() -> None:
    row = dict.fromkeys(TASK_KEYS) | {"discarded_branches": 2, "discarded_cost_share": 0.4375}
    none = row | {"discarded_branches": 0, "discarded_cost_share": 0.0}
    text = render_table({"policies": {"appliance": row, "round-robin": none}})
    lines = [line for line in text.splitlines() if "discarded" in line]
    assert lines == [
        "appliance: 2 discarded branches (results their parent did not keep), "
        "43.8% of the attempted cost"
    ]


@pytest.mark.parametrize(
    ("outcomes", "goodput", "per_success"),
    [
        ([outcome("a", start=0, finish=1, deadline=None, gpu_s=1.0)], None, 0.5),
        ([outcome("a", start=0, finish=1, deadline=None, gpu_s=1.0, verified=False)], None, None),
        ([outcome("a", start=0, finish=9, deadline=5, gpu_s=1.0, succeeds=False)], 0.0, None),
        ([], None, None),
    ],
)
def test_no_deadlines_or_no_successes_give_null(
    outcomes: list[TaskOutcome], goodput: float | None, per_success: float | None
) -> None:
    m = task_metrics(outcomes, gpu_second=0.5)
    assert m["deadline_goodput"] == goodput and m["cost_per_success"] == per_success


def test_gpu_seconds_split_by_scheduled_tokens() -> None:
    gpu = GpuSeconds()
    gpu.on_step(0, 0.0, StepResult(1.0, [], [], 4, {"a": 3, "b": 1}))
    gpu.on_step(0, 1.0, StepResult(0.2, [], [], 2, {"a": 1, "c": 1}))
    gpu.on_step(0, 1.2, StepResult(0.0, [], [], 0, {}))
    assert gpu.by_request == pytest.approx({"a": 0.85, "b": 0.25, "c": 0.1})
