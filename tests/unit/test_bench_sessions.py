"""The live run of recorded sessions (`bench/sessions.py`) against a fake appliance, and its
figures (`bench/session_figures.py`): requests in order, sub-agents beside the parent that
waits for them, users recycling the list, requests over the window skipped and counted;
the counted window, nearest-rank percentiles and the router's CPU per turn from /metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

from appliance.bench.report import AgentStepResult
from appliance.bench.session_figures import (
    LiveTurn,
    SessionRecorder,
    metric_sums,
    router_figures,
    session_figures,
)
from appliance.bench.sessions import LiveSessions, SessionRunPlan
from appliance.workload.agent_traces import (
    AgentSessionTrace,
    SubagentTrace,
    TraceRequest,
    TraceSubagents,
)


def req(n_in: int, ids: Iterable[int], *, out: int = 10) -> TraceRequest:
    return TraceRequest(0.0, n_in, out, tuple(ids), "tool_use", 0.0, None)


class FakeClient:
    """Answers every request at once, but refuses one of `limit` words or more as the
    appliance refuses a prompt over the window (400); remembers who asked, with how many
    words."""

    def __init__(self, limit: int) -> None:
        self.sent: list[tuple[str, int]] = []
        self.limit = limit

    async def step(
        self,
        task_id: str,
        messages: list[dict[str, str]],
        *,
        headers: Mapping[str, str],
        options: Mapping[str, Any] | None = None,
    ) -> tuple[AgentStepResult, str]:
        assert headers == {"X-Session-ID": task_id}
        words = sum(len(m["content"].split(" ")) for m in messages)
        self.sent.append((task_id, words))
        await asyncio.sleep(0)
        if words >= self.limit:
            return AgentStepResult(task_id, False, error="400 maximum context length"), ""
        return AgentStepResult(task_id, True, words, 0, 1, 0.01, 0.02), ""


def run(
    sessions: list[AgentSessionTrace], *, users: int, limit: int
) -> tuple[FakeClient, SessionRecorder]:
    client, rec = FakeClient(limit), SessionRecorder()
    plan = SessionRunPlan("t", users, 0.2, 0.0, 1.0, 0.0, limit)
    asyncio.run(LiveSessions(client, sessions, plan, rec).run())  # type: ignore[arg-type]
    return client, rec


def test_subagents_run_beside_a_parent_that_waits_and_long_requests_are_skipped() -> None:
    sub = SubagentTrace("a", None, "completed", 5.0, 2.0, 0, 0, (req(64, [50]), req(128, [50, 51])))
    session = AgentSessionTrace(
        "s",
        64,
        "local",
        0,
        0,
        (req(100, [1]), TraceSubagents((sub,)), req(999, []), req(2000, []), req(200, [1, 2, 3])),
    )
    client, rec = run([session], users=1, limit=500)
    first = [(sid.split("-", 1)[1], n) for sid, n in client.sent[:5]]
    assert first == [
        ("u0.1:s", 100),
        ("u0.1:s/sa2.0", 64),
        ("u0.1:s/sa2.0", 128),
        ("u0.1:s", 999),  # sent as a harness sends it, refused; the next skip is not sent
        ("u0.1:s", 200),
    ]
    assert rec.skipped_for_window >= 2 and rec.subagents >= 1
    assert rec.refused_for_window >= 1 and not rec.errors
    assert rec.sessions_started >= 2  # the list recycles
    assert {t.session_id.split(":")[0].split("-", 1)[1] for t in rec.turns} >= {"u0.1", "u0.2"}


def test_every_user_runs_its_own_copy_of_the_sessions() -> None:
    sessions = [AgentSessionTrace(f"s{i}", 64, "local", 0, 0, (req(64, [1]),)) for i in range(3)]
    client, _ = run(sessions, users=2, limit=1000)
    users = {sid.split("-", 1)[1].split(".")[0] for sid, _ in client.sent}
    assert users == {"u0", "u1"}
    assert {sid.rsplit(":", 1)[1] for sid, _ in client.sent} == {"s0", "s1", "s2"}


def turn(sid: str, sent_s: float, *, ttft: float, cached: int, ok: bool = True) -> LiveTurn:
    return LiveTurn(
        sid, sent_s, 100, False, AgentStepResult(sid, ok, 100, cached, 5, ttft, 2 * ttft)
    )


def test_figures_count_the_window_as_the_replay_does() -> None:
    rec = SessionRecorder()
    rec.turns = [
        turn("a", 1.0, ttft=9.0, cached=0),  # in the warm-up
        turn("a", 11.0, ttft=0.1, cached=50),
        turn("a", 20.0, ttft=0.3, cached=90),
        turn("b", 15.0, ttft=0.2, cached=0, ok=False),
        turn("b", 31.0, ttft=0.5, cached=0),  # after the end
    ]
    fig = session_figures(rec, warmup_s=10.0, end_s=30.0)
    assert (fig["requests"], fig["finished"], fig["failed"]) == (3, 2, 1)
    assert fig["hit_rate"] == 140 / 200
    assert fig["ttft_p50_s"] == 0.3 and fig["ttft_p95_s"] == 0.3
    assert fig["session_p50_s"] == round(20.0 + 0.6 - 11.0, 2)


def test_the_routers_cpu_per_turn_comes_from_its_metrics() -> None:
    before = metric_sums(
        "# HELP appliance_process_cpu_seconds_total x\nappliance_process_cpu_seconds_total 1.5\n"
    )
    after = metric_sums(
        "appliance_process_cpu_seconds_total 3.5\n"
        'appliance_routed_turns_total{reason="a"} 30\nappliance_routed_turns_total{reason="b"} 10\n'
        "appliance_forward_seconds_sum 0.2\nappliance_forward_seconds_count 40\n"
    )
    fig = router_figures(before, after)
    assert fig == {
        "router_cpu_s": 2.0,
        "router_turns": 40,
        "router_cpu_ms_per_turn": 50.0,
        "router_forward_ms_mean": 5.0,
    }
    assert router_figures({}, {})["router_cpu_ms_per_turn"] is None
