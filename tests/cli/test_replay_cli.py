"""`appliance replay` with residency baselines and closed-loop workloads, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.workload import generate, load_spec
from tests.paths import MOONCAKE

APPLIANCE = Path(sys.executable).parent / "appliance"
ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, data_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    env["APPLIANCE_DATA_DIR"] = str(data_dir)
    env["PYTHONPATH"] = str(ROOT)  # this checkout's code, whichever the script was built for
    return subprocess.run(
        [str(APPLIANCE), *args], capture_output=True, text=True, env=env, timeout=120
    )


def flags(**options: object) -> list[str]:
    """Command-line flags in the order given: `hbm_gib=4` is `--hbm-gib 4`, a list repeats
    its flag, True is the flag alone."""
    argv = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        for v in value if isinstance(value, list) else [value]:
            argv += [flag] if v is True else [flag, str(v)]
    return argv


def test_residency_baselines_are_rows_of_the_same_run(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    options = flags(limit=150, workers=2, policy="round-robin", residency=["lru", "ttl-pin:30"])
    r = run("replay", str(MOONCAKE), *options, "--report", str(out), data_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "round-robin+ttl-pin:30" in r.stdout
    report = json.loads(out.read_text())
    assert list(report["policies"]) == ["round-robin", "round-robin+ttl-pin:30"]
    pinned = report["policies"]["round-robin+ttl-pin:30"]
    assert pinned["pins"] > 0 and pinned["deadline_goodput"] is None
    assert pinned["cost_per_success"] is None  # a trace has no outcomes


def test_host_gib_gives_each_worker_a_host_tier_and_adds_its_rows(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    options = flags(limit=300, workers=8, hbm_gib=4, host_gib=16, policy="session-hash")
    r = run("replay", str(MOONCAKE), *options, "--report", str(out), data_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "host Mtok" in r.stdout and "session-hash+pooled-host" in r.stdout
    report = json.loads(out.read_text())
    assert report["setup"]["host_gib_per_worker"] == 16.0
    assert "optimal_with_host" in report["bounds"]
    assert report["policies"]["session-hash"]["host_hit_tokens"] > 0


def test_workload_replays_closed_loop(tmp_path: Path) -> None:
    spec = tmp_path / "workload.yaml"
    spec.write_text("seed: 7\nroot_tasks_per_s: 2.0\n")
    out = tmp_path / "report.json"
    options = flags(tasks=4, workers=1, policy="appliance", residency="ttl-pin")
    r = run("replay", "--workload", str(spec), *options, "--report", str(out), data_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "appliance+ttl-pin" in r.stdout and "goodput" in r.stdout
    m = json.loads(out.read_text())["policies"]["appliance+ttl-pin"]
    # Every task runs to its end but those whose session is abandoned (the last turn calls
    # a tool that never answers: the spec's `abandoned` shares).
    tasks = generate(load_spec(spec), root_tasks=4).tasks
    abandoned = sum(1 for t in tasks if t.turns[-1].tool_class is not None)
    assert m["tasks"] == len(tasks) >= 4 and m["gpu_s"] > 0
    assert m["tasks_completed"] == len(tasks) - abandoned


def test_the_reaper_replays_a_workload_with_its_tool_classes_as_priors(tmp_path: Path) -> None:
    spec = tmp_path / "workload.yaml"
    spec.write_text("seed: 7\nroot_tasks_per_s: 2.0\n")
    out = tmp_path / "report.json"
    options = flags(tasks=6, workers=1, policy="appliance", residency="reaper")
    r = run("replay", "--workload", str(spec), *options, "--report", str(out), data_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    m = json.loads(out.read_text())["policies"]["appliance+reaper"]
    assert set(m["residency_by_tool"]["(none)"]) == {"evict"}  # last steps: gone at once
    assert sum(m["residency_by_kind"].values()) >= m["requests"]


def test_the_reaper_restores_on_lead_time_and_keeps_branches_local(tmp_path: Path) -> None:
    spec = tmp_path / "workload.yaml"
    spec.write_text("seed: 7\nroot_tasks_per_s: 2.0\n")
    out = tmp_path / "report.json"
    residency = "reaper+lead-time+branches"
    options = flags(tasks=6, seed=3, workers=1, policy="appliance", residency=residency)
    r = run("replay", "--workload", str(spec), *options, "--report", str(out), data_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "appliance+reaper+lead-time+branches:" in r.stdout  # its prefetch line
    report = json.loads(out.read_text())
    assert report["trace"]["path"].endswith("(seed 3)")
    m = report["policies"]["appliance+reaper+lead-time+branches"]
    assert m["prefetch"]["prefetches"] == len(m["prefetch"]["rows"])
    assert m["prefill_s"] > 0


BEST_OF_THREE = """\
seed: 3
root_tasks_per_s: 1.0
task_classes:
  - {name: best-of-three, weight: 1, prefix_tokens: 1000, tools: {file: 1.0},
     statement_tokens: {median: 200, p95: 200, min: 200, max: 200},
     turns: {median: 3, p95: 3, min: 3, max: 3},
     observation_tokens: {median: 100, p95: 100, min: 100, max: 100},
     output_tokens: {median: 50, p95: 50, min: 50, max: 50},
     success_rate: 1.0, verified_rate: 1.0,
     fanout: {probability: 1.0, min_children: 3, max_children: 3, keep: 1,
              child_turns: {median: 2, p95: 2, min: 2, max: 2}}}
"""


def test_a_workload_replay_reports_its_discarded_branches(tmp_path: Path) -> None:
    """Every root runs three children and keeps one: the report counts the two others of
    each and prices their share (the figures by hand: tests/unit/test_replay_metrics.py)."""
    spec = tmp_path / "best-of-three.yaml"
    spec.write_text(BEST_OF_THREE)
    out = tmp_path / "report.json"
    options = flags(tasks=2, workers=1, policy="appliance")
    r = run("replay", "--workload", str(spec), *options, "--report", str(out), data_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    m = json.loads(out.read_text())["policies"]["appliance"]
    tasks = generate(load_spec(spec), root_tasks=2).tasks
    assert sum(len(turn.discards) for t in tasks for turn in t.turns) == 4
    assert m["tasks"] == 8 and m["discarded_branches"] == 4
    assert 0.0 < m["discarded_cost_share"] < 1.0  # 0.30 when written: roots cost more
    line = "appliance: 4 discarded branches (results their parent did not keep), "
    assert line + f"{m['discarded_cost_share']:.1%} of the attempted cost" in r.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ([], "give a TRACE or --workload FILE"),
        (["{trace}", "--workload", "{spec}"], "give a TRACE or --workload FILE"),
        (["--workload", "{spec}", "--limit", "5"], "a workload takes --tasks N"),
        (["--workload", "{tmp}/nope.yaml"], "cannot read it"),
        (["{trace}", "--residency", "mru"], "unknown residency policy 'mru'"),
        (["{trace}", "--residency", "ttl-pin:soon"], "needs a number of seconds"),
        (["{trace}", "--residency", "reaper+lead-time"], "replay a closed-loop workload"),
        (["{trace}", "--seed", "3"], "--seed draws a workload"),
        (["--workload", "{spec}", "--residency", "reaper+lead-time:soon"], "triggers are"),
    ],
)
def test_bad_input_is_one_line(args: list[str], needle: str, tmp_path: Path) -> None:
    spec = tmp_path / "workload.yaml"
    spec.write_text("seed: 7\n")
    filled = [a.format(trace=MOONCAKE, spec=spec, tmp=tmp_path) for a in args]
    r = run("replay", *filled, data_dir=tmp_path)
    assert r.returncode == 2 and needle in r.stderr and r.stderr.count("\n") == 1, r.stderr


KVCT = ROOT / "tests" / "data" / "kvct"
SMALL_BOX = flags(workers=1, hbm_gib=8, host_gib=16, duration=400, warmup=100)


def test_recorded_agent_sessions_replay_through_each_stack_at_a_fixed_count(
    tmp_path: Path,
) -> None:
    out = tmp_path / "sessions.json"
    options = flags(stack=["vllm", "appliance", "bound"], users=2)
    r = run("replay", str(KVCT), *options, *SMALL_BOX, "--report", str(out), data_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "3 sessions (337 requests)" in r.stdout
    report = json.loads(out.read_text())
    assert [row["stack"] for row in report["rows"]] == ["vllm", "appliance", "bound"]
    assert report["bound_sessions"] is None  # a capacity only a capacity search finds
    for row in report["rows"]:
        assert row["users"] == 2 and 0 < row["ttft_p50_s"] <= row["ttft_p95_s"]
        assert 0 < row["hit_rate"] < 1
        at_p95 = row["ttft_at_p95"]  # where its p95 went, a line of the text report
        assert at_p95["requests"] >= 1 and at_p95["own_prefill_s"] > 0
        assert f"{row['stack']} at 2 users: the {at_p95['requests']} requests within" in r.stdout
    assert "bound_sessions" in report
    assert report["rows"][0]["host_tier"] is False and report["rows"][1]["host_tier"] is True


def test_seed_draws_the_order_the_recorded_sessions_start_in(tmp_path: Path) -> None:
    out = tmp_path / "sessions.json"
    options = flags(stack="appliance", users=1, seed=3)
    r = run("replay", str(KVCT), *options, *SMALL_BOX, "--report", str(out), data_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "3 sessions (337 requests) from" in r.stdout and "in the order of seed 3" in r.stdout
    assert json.loads(out.read_text())["seed"] == 3


def test_a_capacity_search_prints_each_step_and_reports_the_capacity(tmp_path: Path) -> None:
    out = tmp_path / "capacity.json"
    options = flags(stack="vllm", capacity=True, slo_ttft_p95=60)
    # 40 GiB: the sessions' 100k-token prompts fit, so some count of users meets the SLO.
    box = flags(workers=1, hbm_gib=40, host_gib=16, duration=400, warmup=100)
    r = run("replay", str(KVCT), *options, *box, "--report", str(out), data_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    row, bound = json.loads(out.read_text())["rows"]
    steps = row["steps"]
    assert len(steps) >= 2 and r.stderr.count("vllm: ") == len(steps)
    report = json.loads(out.read_text())
    assert bound["stack"] == "bound" and report["bound_sessions"] == bound["capacity_sessions"]
    cap = row["capacity_sessions"]
    meets = [s["users"] for s in steps if s["ttft_p95_s"] <= 60]
    assert meets and cap == max(meets)
    assert all(s["ttft_p95_s"] > 60 for s in steps if s["users"] > cap)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--users", "2", "--stack", "magic"], "unknown stack 'magic'"),
        (["--stack", "vllm"], "give --users N, or --capacity"),
        (["--capacity"], "--capacity goes with --slo-ttft-p95"),
    ],
)
def test_bad_session_replays_are_refused_in_one_line(
    args: list[str], needle: str, tmp_path: Path
) -> None:
    r = run("replay", str(KVCT), *args, data_dir=tmp_path)
    assert r.returncode == 2 and needle in r.stderr, r.stderr
