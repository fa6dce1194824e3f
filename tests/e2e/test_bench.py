"""`appliance bench` against `appliance up --engine sim` on two workers: what the benchmark
counts is what the ledger's rows of the same run and interval say."""

from __future__ import annotations

import json
import sqlite3
import subprocess
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e import ledger_costs
from tests.running import BIN, add_key, appliance_process

pytestmark = pytest.mark.e2e

DURATION_S = 15
# Short tasks, so a short run finishes many of them: two tenants, fan-out from the first
# turn of the first roots (seed 1), deadlines, both outcomes, verified and not.
WORKLOAD = """
seed: 1
max_context_tokens: 30000
root_tasks_per_s: 1.0
tenants: [{name: alice, weight: 2}, {name: bob, weight: 1}]
tool_classes:
  api: {median: 0.5, p95: 2, min: 0.01, max: 5}
  test: {median: 5, p95: 20, min: 1, max: 60}
task_classes:
  - name: quick
    weight: 1
    prefix_tokens: 800
    statement_tokens: {median: 100, p95: 300, min: 10, max: 600}
    turns: {median: 3, p95: 6, min: 1, max: 10}
    observation_tokens: {median: 80, p95: 300, min: 5, max: 600}
    output_tokens: {median: 12, p95: 30, min: 1, max: 60}
    tools: {api: 3, test: 1}
    success_rate: 0.7
    verified_rate: 0.8
    deadline: {probability: 0.5, min_s: 30, max_s: 120}
    fanout:
      probability: 0.4
      min_children: 2
      max_children: 3
      child_turns: {median: 2, p95: 4, min: 1, max: 6}
"""


@dataclass
class BenchRun:
    report: dict[str, Any]
    stdout: str
    bad_key: subprocess.CompletedProcess[str]
    ledger: Path
    state: dict[str, Any]
    """The appliance's state document once the run had ended."""
    costs: list[dict[str, Any]]
    """`appliance costs --json` once the appliance had stopped."""


def bench(url: str, data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "appliance"), "bench", "--url", url, "--data-dir", str(data_dir), *args],
        capture_output=True,
        text=True,
        timeout=DURATION_S + 120,
    )


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BenchRun]:
    data_dir = tmp_path_factory.mktemp("appliance-bench")
    for tenant in ("alice", "bob"):
        add_key(data_dir, tenant)
    ops = add_key(data_dir, "ops", "--admin")
    workload = data_dir / "workload.yaml"
    workload.write_text(WORKLOAD)
    report_file = data_dir / "bench.json"
    # Self-hosted pricing: every attempt costs its share of its worker's GPU-seconds, and the
    # box's idle GPU-seconds, energy and hours are overhead, recorded every second.
    env = {
        "APPLIANCE_COSTS__MODE": "gpu_seconds",
        "APPLIANCE_COSTS__ENERGY_PER_KWH": "0.25",
        "APPLIANCE_COSTS__BOX_PER_HOUR": "20",
        "APPLIANCE_LEDGER__USAGE_PERIOD_S": "1",
    }
    with appliance_process(data_dir, workers=2, env=env) as up:
        bad_key = bench(up.url, data_dir, "--api-key", "sk-wrong", "--duration", "1")
        r = bench(
            up.url,
            data_dir,
            *("--workload", str(workload), "--duration", str(DURATION_S)),
            *("--concurrency", "6", "--time-scale", "0.1", "--drain", "30"),
            *("--report", str(report_file)),
        )
        assert r.returncode == 0, r.stderr
        auth = {"Authorization": f"Bearer {ops}"}
        state = httpx.get(f"{up.url}/admin/v1/state", headers=auth, timeout=30).json()
    # The appliance has stopped: every acknowledged row is in the file.
    report = json.loads(report_file.read_text())
    ledger = data_dir / "ledger.db"
    costs = subprocess.run(
        [str(BIN / "appliance"), "costs", "--db", str(ledger), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    yield BenchRun(report, r.stdout, bad_key, ledger, state, json.loads(costs.stdout))


def query(ledger: Path, sql: str, *params: object) -> list[tuple[Any, ...]]:
    with closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as db:
        return db.execute(sql, params).fetchall()


def test_the_bench_counts_agree_with_the_ledgers_turn_rows(bench_run: BenchRun) -> None:
    rep = bench_run.report
    run = f"%/{rep['run_tag']}-%"
    (n_rows, n_ok, prompt, cached, output, first, last) = query(
        bench_run.ledger,
        "SELECT count(*), sum(outcome = 'ok'), "
        "sum(CASE WHEN outcome = 'ok' THEN prompt_tokens END), "
        "sum(CASE WHEN outcome = 'ok' THEN cached_tokens END), "
        "sum(CASE WHEN outcome = 'ok' THEN output_tokens END), "
        "min(started_at), max(finished_at) FROM turns WHERE task_id LIKE ?",
        run,
    )[0]
    steps, tokens = rep["steps"], rep["tokens"]
    assert steps["ok"] > 0
    assert n_ok == steps["ok"]
    assert n_rows == steps["ok"] + steps["failed"] + steps["abandoned"]
    assert (prompt, cached, output) == (tokens["prompt"], tokens["cached"], tokens["output"])
    assert rep["started_at"] <= first and last <= rep["finished_at"]
    (in_interval,) = query(
        bench_run.ledger,
        "SELECT count(*) FROM turns WHERE started_at >= ? AND finished_at <= ?",
        rep["started_at"],
        rep["finished_at"],
    )[0]
    assert in_interval == n_rows  # the interval holds this run's rows and nothing else
    assert cached > 0  # later turns and other tasks reuse the shared prefix


def test_the_bench_task_outcomes_agree_with_the_ledgers_tasks(bench_run: BenchRun) -> None:
    rep = bench_run.report["tasks"]
    run = f"%/{bench_run.report['run_tag']}-%"
    rows = dict(
        query(
            bench_run.ledger,
            "SELECT status, count(*) FROM tasks WHERE task_id LIKE ? GROUP BY status",
            run,
        )
    )
    assert rep["succeeded"] > 0
    assert rows.get("succeeded", 0) == rep["succeeded"]
    assert rows.get("failed", 0) == rep["failed"]
    assert rows.get("cancelled", 0) == rep["unfinished"]
    assert rows.get("open", 0) == 0  # the run cancels what it leaves unfinished
    (verified,) = query(
        bench_run.ledger,
        "SELECT count(*) FROM tasks WHERE task_id LIKE ? AND status = 'succeeded' AND verified",
        run,
    )[0]
    assert verified == rep["succeeded_verified"]


def test_children_tenants_and_tool_events_reach_the_appliance(bench_run: BenchRun) -> None:
    run = f"%/{bench_run.report['run_tag']}-%"
    children = query(
        bench_run.ledger,
        "SELECT c.task_id, c.parent_task_id, p.task_class FROM tasks c "
        "JOIN tasks p ON p.task_id = c.parent_task_id WHERE c.task_id LIKE ?",
        run,
    )
    assert children and all(cls == "quick" for _, _, cls in children)
    tenants = {t for (t,) in query(bench_run.ledger, "SELECT DISTINCT tenant FROM turns")}
    assert tenants == {"alice", "bob"}
    kinds = dict(
        query(
            bench_run.ledger,
            "SELECT type, count(*) FROM task_events WHERE task_id LIKE ? GROUP BY type",
            run,
        )
    )
    assert kinds.get("tool_started", 0) > 0 and kinds.get("tool_finished", 0) > 0
    (deadlines,) = query(
        bench_run.ledger,
        "SELECT count(*) FROM tasks WHERE task_id LIKE ? AND deadline_at IS NOT NULL",
        run,
    )[0]
    assert deadlines > 0


def test_the_table_shows_latency_percentiles_and_the_cached_share(bench_run: BenchRun) -> None:
    out = bench_run.stdout
    for label in ("step TTFT s", "step e2e s", "task s", "p50", "p95", "p99", "cached"):
        assert label in out, label
    lat = bench_run.report["step_latency_s"]
    assert set(lat["ttft"]) == {"p50", "p95", "p99", "mean"}
    assert lat["e2e"]["p50"] <= lat["e2e"]["p99"]


def test_a_wrong_key_is_one_line_and_exit_2(bench_run: BenchRun) -> None:
    r = bench_run.bad_key
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "refused the API key" in r.stderr


def busy_spans_s(spans: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) spans."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def test_gpu_seconds_divide_each_workers_busy_time_among_its_turns(bench_run: BenchRun) -> None:
    """Self-hosted cost used to be zero: no live turn set `gpu_s` (the task issue). Now each
    worker's GPU-seconds with a turn in flight, by the ledger's own timestamps, are what its
    turns' `gpu_s` add up to, and the state shows the idle rest apart."""
    workers = {w["id"]: w for w in bench_run.state["workers"]}
    rows = query(bench_run.ledger, "SELECT worker, started_at, finished_at, gpu_s FROM turns")
    assert {w for w, *_ in rows if w is not None} == set(workers)  # both served
    for worker, view in workers.items():
        mine = [(start, end, gpu_s) for w, start, end, gpu_s in rows if w == worker]
        charged = sum(gpu_s for *_, gpu_s in mine)
        busy = busy_spans_s([(start, end) for start, end, _ in mine])
        assert charged == pytest.approx(busy, rel=0.05), worker
        assert charged == pytest.approx(view["gpu_busy_s"], rel=0.05), worker
        assert view["gpu_idle_s"] > 0  # the run's start and drain leave the workers idle
    (unpriced,) = query(bench_run.ledger, "SELECT count(*) FROM turns WHERE cost IS NULL")[0]
    assert unpriced == 0


def test_cost_per_success_in_gpu_seconds_is_one_figure_in_table_and_chart(
    bench_run: BenchRun,
) -> None:
    """The Costs screen's table and chart once said 0.0009 and 0.0249 after the same runs:
    both now come from one computation, and self-hosted cost is not zero."""
    costs = bench_run.state["costs"]
    groups = costs["groups"]
    spent = sum(g["cost"] for g in groups)
    succeeded = sum(g["succeeded"] for g in groups)
    assert succeeded > 0 and spent > 0
    (ledger_cost,) = query(bench_run.ledger, "SELECT sum(cost) FROM turns")[0]
    assert spent == pytest.approx(ledger_cost, rel=1e-6)
    last = costs["series"][-1]
    with_overhead = sum(g["total_cost"] for g in groups)  # the chart's figure is the table's
    assert last["cost_per_success"] == pytest.approx(with_overhead / succeeded, rel=1e-6)


def test_the_box_usage_periods_cover_the_run_once_with_each_workers_energy(
    bench_run: BenchRun,
) -> None:
    o = ledger_costs.overhead(bench_run.ledger)
    starts, ends = zip(*o.periods, strict=True)
    assert list(starts[1:]) == list(ends[:-1])  # no gap, no overlap
    assert ends[-1] - starts[0] > DURATION_S  # from the router's start to its stop
    per_period = query(
        bench_run.ledger,
        "SELECT count(*), count(energy_j), min(awake_s) FROM worker_usage GROUP BY period_id",
    )
    assert {(n, measured) for n, measured, _ in per_period} == {(2, 2)}  # simulated power
    # What the ledger priced each period at is what its quantities and the price give.
    (idle, energy, box) = query(
        bench_run.ledger,
        "SELECT sum(idle_cost), sum(energy_cost), (SELECT sum(box_cost) FROM usage_periods) "
        "FROM worker_usage",
    )[0]
    assert (idle, energy, box) == pytest.approx((o.idle, o.energy, o.box), rel=1e-9)
    assert o.idle > 0 and o.energy > 0 and o.box > 0


def test_cost_per_success_counts_the_idle_box_in_the_report_and_the_console(
    bench_run: BenchRun,
) -> None:
    """The box's idle time was charged to no one: at 87 % idle, cost per successful task
    understated its cost up to 8 times (issue 40). Now `appliance costs` and the console
    both show the direct cost and a share of the overhead, and agree with the ledger's rows
    worked out by hand."""
    whole = ledger_costs.overhead(bench_run.ledger)
    by_hand = ledger_costs.groups(bench_run.ledger, whole.total)
    report = {(r["task_class"], r["tenant"]): r for r in bench_run.costs}
    assert report.keys() == by_hand.keys()
    for key, g in by_hand.items():
        row = report[key]
        assert (row["tasks"], row["succeeded"]) == (g.tasks, g.succeeded), key
        assert row["cost"] == pytest.approx(g.cost, rel=1e-6), key
        assert row["gpu_s"] == pytest.approx(g.gpu_s, rel=1e-6), key
        assert row["overhead"] == pytest.approx(g.overhead, rel=1e-6), key
        assert row["total_cost"] == pytest.approx(g.cost + g.overhead, rel=1e-6), key
        assert row["cost_per_success"] == pytest.approx(g.per_success, rel=1e-6), key
    # The idle time is in it, and raises what a success costs above its direct cost.
    assert whole.idle > 0 and whole.idle_gpu_s > 0
    for row in bench_run.costs:
        if row["succeeded"]:
            assert row["cost_per_success"] > row["direct_cost_per_success"] > 0
    # The console: the overhead the ledger had acknowledged when the state was read.
    costs = bench_run.state["costs"]
    shown = costs["overhead"]
    assert shown["through"] is not None
    seen = ledger_costs.overhead(bench_run.ledger, through=shown["through"])
    assert seen.idle > 0
    assert shown["total"] == pytest.approx(seen.total, rel=1e-6)
    assert shown["idle_gpu_s"] == pytest.approx(seen.idle_gpu_s, rel=1e-6)
    at_read = ledger_costs.groups(bench_run.ledger, seen.total)
    state_groups = {(g["task_class"], g["tenant"]): g for g in costs["groups"]}
    assert state_groups.keys() == at_read.keys()
    for key, g in at_read.items():
        assert state_groups[key]["overhead"] == pytest.approx(g.overhead, rel=1e-6), key
        assert state_groups[key]["cost_per_success"] == pytest.approx(g.per_success, rel=1e-6)
    succeeded = sum(g.succeeded for g in at_read.values())
    total = sum(g.cost + g.overhead for g in at_read.values())
    assert costs["series"][-1]["cost_per_success"] == pytest.approx(total / succeeded, rel=1e-6)
