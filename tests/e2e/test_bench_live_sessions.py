"""`appliance bench --trace DIR --users N`: the vendored recorded sessions (tests/data/kvct)
driven live against `appliance up --engine sim` on two workers with the replay's box (64-token
blocks, a 131,072-token window): the report has the replay's figures and the router's CPU,
every request the trace asks to end in a tool call does, and a session's later turns find
its earlier prompt cached."""

from __future__ import annotations

import json
import subprocess
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest

from tests.paths import DATA
from tests.running import BIN, add_key, appliance_process

pytestmark = pytest.mark.e2e

DURATION_S = 20
BOX = {
    "APPLIANCE_ENGINE__BLOCK_SIZE": "64",
    "APPLIANCE_ENGINE__MAX_MODEL_LEN": "131072",
    # 16 GiB of KV per worker at the bundled profile's 128 KiB a token (the window), and
    # vLLM's null block
    "APPLIANCE_ENGINE__KV_CACHE_MEMORY_BYTES": str((16 << 30) + 64 * 131072),
}


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Any], str]]:
    data_dir = tmp_path_factory.mktemp("appliance-bench-sessions")
    add_key(data_dir, "default")
    out = data_dir / "bench.json"
    with appliance_process(data_dir, workers=2, env=BOX) as up:
        run = subprocess.run(
            [
                str(BIN / "appliance"),
                "bench",
                "--url",
                up.url,
                "--data-dir",
                str(data_dir),
                "--trace",
                str(DATA / "kvct"),
                "--users",
                "2",
                "--duration",
                str(DURATION_S),
                "--warmup",
                "2",
                "--time-scale",
                "0.02",
                "--drain",
                "60",
                "--report",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=DURATION_S + 180,
        )
    assert run.returncode == 0, run.stderr
    yield json.loads(out.read_text()), run.stdout


def test_the_report_has_the_replays_figures_and_the_routers_cpu(
    report: tuple[dict[str, Any], str],
) -> None:
    rep, table = report
    fig = rep["figures"]
    assert rep["run"]["users"] == 2 and rep["run"]["max_model_len"] == 131072
    for key in ("ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "step_p50_s", "session_p50_s"):
        assert isinstance(fig[key], float), key
    assert fig["ttft_p50_s"] <= fig["ttft_p95_s"] <= fig["ttft_p99_s"]
    assert 0 < fig["hit_rate"] < 1
    assert fig["requests"] > 0 and fig["failed"] == 0
    assert fig["sessions_started"] >= 2
    assert fig["skipped_for_window"] >= 0
    assert fig["router_turns"] >= fig["finished"] and fig["router_cpu_ms_per_turn"] > 0
    for label in ("ttft_p95_s", "hit_rate", "skipped_for_window", "router_cpu_ms_per_turn"):
        assert label in table, label
    refused = fig["refused_for_window"]
    assert f"{refused} refused for the window" in table and refused <= fig["skipped_for_window"]


def test_requests_that_ended_in_a_tool_call_do_and_answers_are_the_traces_length(
    report: tuple[dict[str, Any], str],
) -> None:
    rows = [r for r in report[0]["turns"] if r["ok"]]
    asked = [r for r in rows if r["tool_call"]]
    assert asked and all(r["finish_reason"] == "tool_calls" for r in asked)
    assert all(r["finish_reason"] != "tool_calls" for r in rows if not r["tool_call"])
    # the prompt is the trace's tokens and the chat template's (6 a message, 5 a chat)
    assert all(r["input_tokens"] < r["prompt_tokens"] < r["input_tokens"] + 2000 for r in rows)


def test_a_sessions_later_turns_find_its_earlier_prompt_cached(
    report: tuple[dict[str, Any], str],
) -> None:
    by_session: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in report[0]["turns"]:
        if r["ok"]:
            by_session[r["session"]].append(r)
    grown = 0
    for turns in by_session.values():
        cached = [t["cached_tokens"] for t in sorted(turns, key=lambda t: t["sent_s"])]
        if len(cached) >= 3:
            assert cached[-1] > cached[0]
            grown += 1
    assert grown >= 1
