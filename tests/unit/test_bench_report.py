"""The benchmark's arithmetic and key lookup, without an appliance: percentiles, the report's
sums, the table, and which API key each tenant sends with."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.bench.client import BadInput
from appliance.bench.report import AgentStepResult, Recorder, TaskResult, build_report, percentiles
from appliance.bench.report import render as render_report
from appliance.bench.run import resolve_keys
from appliance.config.keystore import add_key
from appliance.workload.text import words


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([], {}),
        ([2.0], {"p50": 2.0, "p95": 2.0, "p99": 2.0, "mean": 2.0}),
        ([4.0, 1.0, 3.0, 2.0], {"p50": 3.0, "p95": 4.0, "p99": 4.0, "mean": 2.5}),
        ([float(i) for i in range(100)], {"p50": 50.0, "p95": 95.0, "p99": 99.0, "mean": 49.5}),
        ([float(i) for i in range(20)], {"p50": 10.0, "p95": 19.0, "p99": 19.0, "mean": 9.5}),
    ],
)
def test_percentiles_are_the_session_reports_nearest_rank(
    values: list[float], expected: dict[str, float]
) -> None:
    assert percentiles(values) == pytest.approx(expected)


def test_the_hundredth_percentile_is_the_largest_value() -> None:
    assert percentiles([3.0, 1.0, 2.0], qs=(0, 100)) == {"p0": 1.0, "p100": 3.0, "mean": 2.0}


def make_recorder() -> Recorder:
    rec = Recorder()
    rec.steps += [
        AgentStepResult("a", True, 1000, 600, 50, ttft_s=0.1, e2e_s=1.0, worker="w0"),
        AgentStepResult("a", True, 1200, 1100, 40, ttft_s=0.2, e2e_s=2.0, worker="w1"),
        AgentStepResult("b", False, e2e_s=0.1, error="503 no healthy worker"),
        AgentStepResult(
            "c", False, e2e_s=0.1, error="429 the deadline is 1.5 s away", rejected=True
        ),
    ]
    rec.tasks += [
        TaskResult("a", True, "succeeded", True, 2, 10.0),
        TaskResult("b", False, "failed", False, 0, 1.0, reason="503 no healthy worker"),
        TaskResult("c", True, "unfinished", False, 0, 5.0),
    ]
    rec.error("429 the deadline is 1.5 s away")
    rec.error("429 the deadline is 0.25 s away")
    return rec


def test_the_report_sums_only_successful_steps_and_finished_tasks() -> None:
    run = {
        "url": "u",
        "model": "m",
        "concurrency": 2,
        "duration_s": 10.0,
        "time_scale": 0.1,
        "run_tag": "bench-x",
    }
    rep = build_report(make_recorder(), run, wall_s=20.0)
    assert rep["steps"] | {"by_worker": None} == {
        "ok": 2,
        "failed": 1,
        "rejected": 1,
        "abandoned": 0,
        "per_s": 0.1,
        "by_worker": None,
    }
    assert rep["tokens"]["prompt"] == 2200 and rep["tokens"]["cached"] == 1700
    assert rep["tokens"]["cached_share"] == pytest.approx(1700 / 2200, abs=1e-4)
    assert rep["tasks"]["finished"] == 2 and rep["tasks"]["succeeded_verified"] == 1
    assert rep["tasks"]["unfinished"] == 1
    assert rep["errors"] == {"429 the deadline is # s away": 2}
    table = render_report(rep)
    assert "step TTFT s" in table and "77.3 %" in table and "1 rejected" in table


@pytest.mark.parametrize(
    ("stored", "tenants", "api_key", "expected"),
    [
        ([], ["default"], "sk-given", {"default": "sk-given"}),
        ([("default", False), ("admin", True)], ["default"], None, {"default": "default"}),
        (
            [("alice", False), ("bob", False)],
            ["alice", "bob"],
            None,
            {"alice": "alice", "bob": "bob"},
        ),
        ([("admin", True)], ["admin"], None, None),
        ([("alice", False)], ["alice", "bob"], None, None),
    ],
)
def test_each_tenant_sends_with_its_own_key(
    tmp_path: Path,
    stored: list[tuple[str, bool]],
    tenants: list[str],
    api_key: str | None,
    expected: dict[str, str] | None,
) -> None:
    keys = {
        name: add_key(tmp_path / "api-keys.toml", name, admin=admin).key for name, admin in stored
    }
    if expected is None:
        with pytest.raises(BadInput, match="no API key named"):
            resolve_keys(tenants, api_key=api_key, data_dir=tmp_path)
        return
    got = resolve_keys(tenants, api_key=api_key, data_dir=tmp_path)
    assert got == {t: keys.get(v, v) for t, v in expected.items()}


def test_the_same_key_gives_the_same_text_and_about_the_asked_length() -> None:
    assert words("k", 300) == words("k", 300)
    assert words("k", 300) != words("j", 300)
    assert len(words("k", 300).split()) == 300
