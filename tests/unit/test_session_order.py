"""The order recorded sessions start in: the files', or one drawn from a seed."""

from __future__ import annotations

from appliance.replay.sessions.session_report import session_order
from appliance.workload.agent_traces import AgentSessionTrace


def _sessions(n: int) -> list[AgentSessionTrace]:
    return [AgentSessionTrace(f"trace_{i:04d}", 64, "local", 0, 0, ()) for i in range(n)]


def test_without_a_seed_the_sessions_start_in_the_files_order() -> None:
    sessions = _sessions(5)
    assert session_order(sessions, None) == sessions


def test_a_seed_draws_the_same_shuffle_every_time_and_another_seed_another() -> None:
    sessions = _sessions(40)
    drawn = session_order(sessions, 1)
    assert sorted(s.session_id for s in drawn) == [s.session_id for s in sessions]
    assert drawn != sessions
    assert session_order(sessions, 1) == drawn
    assert session_order(sessions, 2) != drawn
    assert [s.session_id for s in sessions] == [f"trace_{i:04d}" for i in range(40)]  # kept
