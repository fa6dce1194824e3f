"""Recorded agent sessions closed loop (`replay/sessions/session_loop.py`) and through a stack
(`replay/sessions/session_replay.py`), on the vendored real sessions (tests/data/kvct) and on
hand-made ones: think times after answers, sub-agents beside their parent, users recycled,
prompts' blocks hashed as the engines hash them, the window and the capacity search."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import pytest

from appliance.domain.block_hash import BlockHash, BlockHasher, HashAlgo, RequestKeys
from appliance.perf.agent_batching import AGENT_BATCH_TOKENS, AGENT_PREFILL_CAP_TOKENS
from appliance.policy.residency import HeldSession, IdleSession, ResidencyAction
from appliance.replay.runner import make_setup
from appliance.replay.sessions.capacity_search import capacity, first_count
from appliance.replay.sessions.run_window import PASS_STARTS_PER_USER, RunWindow
from appliance.replay.sessions.session_bound import (
    ClairvoyantResidency,
    free_restores,
    session_ttft_floor,
)
from appliance.replay.sessions.session_loop import PERSON, SessionLoop, block_tokens
from appliance.replay.sessions.session_replay import STACKS, replay_stack
from appliance.sim.core.engine import SimEngine
from appliance.sim.runtime.virtual import Arrival, RequestRecord
from appliance.workload.agent_traces import (
    AgentSessionTrace,
    SubagentTrace,
    TraceRequest,
    TraceSubagents,
    read_agent_sessions,
)
from tests.paths import DATA


def req(
    n_in: int, ids: Iterable[int], *, think: float = 0.0, out: int = 10, stop: str = "tool_use"
) -> TraceRequest:
    return TraceRequest(0.0, n_in, out, tuple(ids), stop, think, None)


def trace(sid: str, *steps: TraceRequest | TraceSubagents, system: int = 0) -> AgentSessionTrace:
    return AgentSessionTrace(sid, 64, "local", system, 0, steps)


def loop(
    *sessions: AgentSessionTrace,
    users: int = 1,
    bs: int = 64,
    duration_s: float = 1e9,
    warmup_s: float = 0.0,
) -> SessionLoop:
    hasher = BlockHasher(HashAlgo.SHA256, bs)
    return SessionLoop(
        sessions,
        users=users,
        hasher=hasher,
        max_model_len=4096,
        window=RunWindow(duration_s, warmup_s),
    )


def finish(arrival: Arrival, at_s: float) -> RequestRecord:
    r = arrival.request
    return RequestRecord(
        r.request_id,
        0,
        arrival.time_s,
        len(r.prompt_token_ids),
        first_token_s=at_s,
        finish_s=at_s,
        output_tokens=r.max_tokens,
    )


def test_each_request_follows_the_previous_answer_by_its_think_time() -> None:
    s = trace(
        "a",
        req(200, [1, 2, 3]),
        req(300, [1, 2, 3, 4], think=7.5),
        stop_last := req(330, [1, 2, 3, 4, 5], think=2.0, stop="end_turn"),
    )
    lp = loop(s)
    [first] = list(lp.arrivals())
    assert first.time_s == 0.0 and len(first.request.prompt_token_ids) == 200
    [second] = lp.on_finish(finish(first, 3.0))
    assert second.time_s == pytest.approx(10.5)  # 3.0 + 7.5
    assert lp.hint(second.request.request_id).ends_in_tool_call  # type: ignore[union-attr]
    [third] = lp.on_finish(finish(second, 11.0))
    assert third.time_s == pytest.approx(13.0)
    last = lp.hint(third.request.request_id)
    assert last is not None and not stop_last.ends_in_tool_call
    assert last.tool_class == PERSON  # an answer to the person: the person comes back


def test_a_finished_session_is_replaced_by_the_next_recording_until_the_end() -> None:
    lp = loop(trace("a", req(200, [1, 2, 3])), trace("b", req(100, [1])), duration_s=20.0)
    [a] = list(lp.arrivals())
    [b] = lp.on_finish(finish(a, 5.0))
    assert b.request.session_id == "u0.2:b" and b.time_s == 5.0
    [a2] = lp.on_finish(finish(b, 6.0))  # the list cycles: "a" again, a new run of it
    assert a2.request.session_id == "u0.3:a"
    assert lp.on_finish(finish(a2, 21.0)) == []  # past the end: nothing more is sent
    assert (lp.counts.sessions_started, lp.counts.sessions_finished) == (3, 3)


def test_by_default_every_recording_starts_once_and_the_window_ends_at_the_last() -> None:
    hasher = BlockHasher(HashAlgo.SHA256, 64)
    sessions = [trace("a", req(200, [1, 2, 3])), trace("b", req(100, [1]))]
    lp = SessionLoop(sessions, users=1, hasher=hasher, max_model_len=4096)
    [a] = list(lp.arrivals())
    [b] = lp.on_finish(finish(a, 5.0))
    assert b.request.session_id == "u0.2:b" and lp.end_s == 5.0  # the last one started
    assert lp.on_finish(finish(b, 6.0)) == [] and lp.passed  # none is replayed twice
    assert (lp.counts.sessions_started, lp.counts.sessions_finished) == (2, 2)


def test_one_pass_sends_nothing_past_the_last_start_and_knows_which_runs_ended() -> None:
    """After the last recording starts (the counted window's end), a turn due later is not
    sent: what follows would count for nothing. A run cut off there has not ended."""
    hasher = BlockHasher(HashAlgo.SHA256, 64)
    turns = (req(200, [1, 2, 3]), req(300, [1, 2, 3, 4], think=1.0), req(400, range(7), think=1.0))
    sessions = [trace("a", *turns), *(trace(n, req(100, [1])) for n in "bcd")]
    lp = SessionLoop(sessions, users=2, hasher=hasher, max_model_len=4096)
    a0, b0 = list(lp.arrivals())
    [a1] = lp.on_finish(finish(a0, 2.0))
    assert a1.time_s == 3.0
    [c0] = lp.on_finish(finish(b0, 2.2))
    [d0] = lp.on_finish(finish(c0, 2.5))  # "c" ends, "d" starts: the last start
    assert d0.request.session_id == "u1.3:d" and lp.end_s == 2.5
    assert lp.on_finish(finish(a1, 3.5)) == []  # the third turn of "a" would come at 4.5
    assert lp.on_finish(finish(d0, 4.0)) == [] and lp.passed
    assert lp.ended == {"u1.1:b", "u1.2:c", "u1.3:d"}
    assert (lp.counts.sessions_started, lp.counts.sessions_finished) == (4, 3)


def test_a_pass_over_a_short_list_cycles_it_to_two_starts_a_user() -> None:
    """Two recordings, three users: one pass starts six sessions, the list cycled (each a
    new run), and the window ends at the sixth start, not as it begins."""
    assert PASS_STARTS_PER_USER == 2
    hasher = BlockHasher(HashAlgo.SHA256, 64)
    sessions = [trace("a", req(200, [1, 2, 3])), trace("b", req(100, [1]))]
    window = RunWindow(warmup_s=0.0)
    lp = SessionLoop(sessions, users=3, hasher=hasher, max_model_len=4096, window=window)
    first = list(lp.arrivals())
    assert [f.request.session_id for f in first] == ["u0.1:a", "u1.1:b", "u2.1:a"]
    assert lp.end_s == math.inf
    [fourth] = lp.on_finish(finish(first[0], 1.0))
    [fifth] = lp.on_finish(finish(first[1], 2.0))
    [sixth] = lp.on_finish(finish(first[2], 3.0))
    assert [x.request.session_id for x in (fourth, fifth, sixth)] == ["u0.2:b", "u1.2:a", "u2.2:b"]
    assert lp.end_s == 3.0 and lp.passed
    assert lp.on_finish(finish(fourth, 4.0)) == []
    assert lp.counts.sessions_started == 6


def test_a_cycled_pass_gives_up_on_the_turns_of_every_start() -> None:
    """Two one-turn recordings, 20 users: the pass holds 40 turns, so a p95 over 1 s is sure
    at the second turn over it (of the list alone, 2 turns, at the first)."""
    hasher = BlockHasher(HashAlgo.SHA256, 64)
    sessions = [trace("a", req(200, [1, 2, 3])), trace("b", req(100, [1]))]
    window = RunWindow(warmup_s=0.0, give_up_over_p95_s=1.0)
    lp = SessionLoop(sessions, users=20, hasher=hasher, max_model_len=4096, window=window)
    firsts = list(lp.arrivals())  # sent at 0 s: not after the warm-up, never counted
    [x] = lp.on_finish(finish(firsts[0], 0.5))
    [y] = lp.on_finish(finish(firsts[1], 0.5))
    assert lp.on_finish(finish(x, 2.0)) and lp.gave_up_s == math.inf  # one over: not sure
    assert lp.on_finish(finish(y, 2.0)) == [] and lp.gave_up_s == 2.0


def test_a_capacity_step_ends_once_its_p95_is_sure_to_miss() -> None:
    """40 one-turn sessions: a p95 over 40 turns or fewer is over 1 s once 2 are."""
    hasher = BlockHasher(HashAlgo.SHA256, 64)
    sessions = [trace(f"s{i}", req(200, [1, 2, 3])) for i in range(40)]
    window = RunWindow(warmup_s=0.0, give_up_over_p95_s=1.0)
    lp = SessionLoop(sessions, users=2, hasher=hasher, max_model_len=4096, window=window)
    a, b = list(lp.arrivals())
    [c] = lp.on_finish(finish(a, 0.5))  # within the SLO
    [d] = lp.on_finish(finish(b, 3.0))  # over it, but sent at 0 s: not after the warm-up
    [e] = lp.on_finish(finish(c, 4.0))  # over it: one
    assert lp.gave_up_s == math.inf and lp.end_s == math.inf
    assert lp.on_finish(finish(d, 5.0)) == [] and lp.gave_up_s == 5.0  # two: sure
    assert lp.end_s == 5.0 and lp.on_finish(finish(e, 5.5)) == []  # nothing more starts
    assert lp.counts.sessions_started == 5
    going = SessionLoop(sessions, users=2, hasher=hasher, max_model_len=4096)
    a, b = list(going.arrivals())
    assert going.on_finish(finish(a, 3.0)) and going.on_finish(finish(b, 3.0))  # no SLO


def test_users_ramp_up_over_the_warm_up() -> None:
    lp = loop(trace("a", req(200, [1, 2, 3])), users=4, warmup_s=100.0, duration_s=500.0)
    assert [a.time_s for a in lp.arrivals()] == [0.0, 25.0, 50.0, 75.0]


def test_a_prompt_that_does_not_fit_the_window_is_skipped_and_counted() -> None:
    lp = loop(trace("a", req(200, [1, 2, 3]), req(5000, range(1, 79)), req(300, [1, 2, 3, 4])))
    [a] = list(lp.arrivals())
    [c] = lp.on_finish(finish(a, 1.0))
    assert len(c.request.prompt_token_ids) == 300
    assert (lp.counts.skipped_for_window, lp.counts.skipped_tokens) == (1, 5000)


def test_the_first_prompt_over_the_window_in_a_run_of_skips_ends_the_sessions_own_kv() -> None:
    """Of a run of skipped requests, the first whose prompt alone overflows the window is
    heard, at the previous answer's end, with the previous prompt's blocks past the warm
    prefix; one that only asks too long an answer, a second in the run, is not."""
    heard: list[tuple[str, int, float]] = []
    sent = [req(640, range(1, 11)), req(4090, range(1, 64), out=50), req(5000, range(1, 79))]
    lp = loop(trace("a", *sent, req(6000, range(1, 94)), req(700, range(1, 12))), users=1)
    lp.on_overflow = lambda sid, own, now: heard.append((sid, len(own), now))
    [a] = list(lp.arrivals())
    [b] = lp.on_finish(finish(a, 1.0))
    assert heard == [("u0.1:a", 10, 1.0)]  # no warm prefix: every block its own
    assert lp.counts.skipped_for_window == 3 and len(b.request.prompt_token_ids) == 700
    warm = trace("w", req(640, range(1, 11)), req(5000, range(1, 79)), system=512)
    lw = loop(warm)
    lw.on_overflow = lambda sid, own, now: heard.append((sid, len(own), now))
    [c] = list(lw.arrivals())
    lw.on_finish(finish(c, 2.0))  # its last request: the user starts the next session
    assert heard[1:] == [("u0.1:w", 6, 2.0)]  # 4 of its 10 blocks the warm prefix


@pytest.mark.parametrize("bs", [16, 64, 128])
def test_block_hashes_are_the_engines_for_the_ids_and_a_resent_prefix_shares_them(bs: int) -> None:
    s = trace("a", req(256, [1, 2, 3, 4]), req(384, [1, 2, 3, 9, 10, 11]))
    lp = loop(s, bs=bs)
    [a] = list(lp.arrivals())
    [b] = lp.on_finish(finish(a, 1.0))
    ha, hb = a.request.block_hashes, b.request.block_hashes
    assert ha is not None and hb is not None
    assert (len(ha), len(hb)) == (256 // bs, 384 // bs)
    shared = 3 * 64 // bs  # ids 1-3, as whole blocks of the workers' size
    assert ha[:shared] == hb[:shared] and ha[shared] != hb[shared]
    # They chain as an engine hashes the ids' tokens: each after its parent, salted.
    tokens = block_tokens([1, 2, 3, 9], "u0.1:a")
    engine = BlockHasher(HashAlgo.SHA256, bs).hash_blocks(tokens, keys=RequestKeys("agents"))
    assert hb[: len(engine)] == engine


def test_only_the_warm_share_of_the_system_prompt_is_shared_between_sessions() -> None:
    a = trace("a", req(640, range(1, 11)), system=512)  # 8 blocks of system: 4 warm
    lp = loop(a, a, users=2)
    first, second = lp.arrivals()
    h1, h2 = first.request.block_hashes, second.request.block_hashes
    assert h1 is not None and h2 is not None
    assert h1[:4] == h2[:4] and h1[4] != h2[4]  # two runs of one recording share no more


def test_sub_agents_run_beside_the_parent_which_waits_for_them() -> None:
    agents = TraceSubagents(
        (
            SubagentTrace("x", "Explore", "completed", 30.0, 20.0, 0, 0, (req(128, [1, 2]),)),
            SubagentTrace("y", "Explore", "async_launched", 10.0, None, 0, 0, (req(128, [5, 6]),)),
        )
    )
    s = trace("p", req(200, [1, 2, 3]), agents, req(300, [1, 2, 3, 4], think=25.0))
    lp = loop(s)
    [p0] = list(lp.arrivals())
    x, y = lp.on_finish(finish(p0, 1.0))
    assert {x.request.session_id, y.request.session_id} == {"u0.1:p/sa2.0", "u0.1:p/sa2.1"}
    assert lp.on_finish(finish(y, 2.0)) == []  # in the background: nobody waits for it
    [p1] = lp.on_finish(finish(x, 4.0))  # the waited one ends: the parent goes on
    assert p1.request.session_id == "u0.1:p"
    assert p1.time_s == pytest.approx(4.0 + 25.0 - 20.0)  # its think time counted them
    assert lp.counts.subagents == 2


def test_an_answers_stop_is_what_the_residency_policy_hears_and_no_more() -> None:
    s = trace(
        "a",
        req(200, [1, 2, 3]),
        req(300, [1, 2, 3, 4], stop="end_turn"),
        req(330, [1, 2, 3, 4, 5], stop=""),
        req(400, range(1, 7)),
    )
    lp = loop(s)
    hints = []
    [a] = list(lp.arrivals())
    for at in (1.0, 2.0, 3.0, 4.0):
        hints.append(lp.hint(a.request.request_id))
        follow = lp.on_finish(finish(a, at))
        a = follow[0] if follow else a
    got = [(h.ends_in_tool_call, h.tool_class, h.expected_wait_s) for h in hints if h]
    assert got == [(True, None, None), (True, PERSON, None), (None, None, None), (True, None, None)]


def test_the_clairvoyant_loop_tells_each_true_wait_and_the_last_request() -> None:
    s = trace(
        "a",
        req(200, [1, 2, 3]),
        req(9000, range(1, 141), think=3.0),
        req(300, [1, 2, 3, 4], think=7.0),
    )
    hasher = BlockHasher(HashAlgo.SHA256, 64)
    window = RunWindow(1e9, 0.0)
    lp = SessionLoop(
        [s], users=1, hasher=hasher, max_model_len=4096, window=window, clairvoyant=True
    )
    [a] = list(lp.arrivals())
    first = lp.hint(a.request.request_id)
    assert first is not None and first.expected_wait_s == 7.0  # the one it will send next
    [b] = lp.on_finish(finish(a, 1.0))
    last = lp.hint(b.request.request_id)
    assert last is not None and last.session_ends and last.expected_wait_s is None


def test_the_clairvoyant_order_holds_until_the_return_and_gives_way_furthest_first() -> None:
    policy = ClairvoyantResidency()

    def idle(sid: str, wait: float | None) -> IdleSession:
        return IdleSession(sid, 640, 100.0, True, None, 1, wait, 0.1, 0.9)

    soon = policy.decide(idle("soon", 5.0), 100.0)
    late = policy.decide(idle("late", 500.0), 100.0)
    assert soon.action is ResidencyAction.HOLD and soon.until_s == 106.0
    assert policy.decide(idle("gone", None), 100.0).action is ResidencyAction.EVICT
    held = [HeldSession(s, 640, 100.0, 1e9) for s in ("late", "gone", "soon")]
    order = sorted(held, key=lambda h: policy.priority(h, 101.0))
    assert [h.session_id for h in order] == ["gone", "late", "soon"]
    assert late.action is ResidencyAction.HOLD


def test_restores_are_free_for_the_bound_and_nothing_else_changes() -> None:
    _, latency = make_setup(workers=1, hbm_gib=4, block_size=64)
    free = free_restores(latency)
    assert free.h2d.copy_s(10**9) == 0.0 and latency.h2d.copy_s(10**9) > 0.0
    assert free.prefill_s(1000, 500) == latency.prefill_s(1000, 500)


SLICE = read_agent_sessions(DATA / "kvct")


def test_every_stack_replays_the_real_sessions_and_counts_only_the_window() -> None:
    setup, latency = make_setup(workers=1, hbm_gib=4, host_gib=8, block_size=64)
    window = RunWindow(duration_s=400.0, warmup_s=100.0)
    rows = {s: replay_stack(SLICE, s, setup, latency, users=3, window=window) for s in STACKS}
    for name, row in rows.items():
        assert row["stack"] == name and row["users"] == 3
        assert isinstance(row["requests"], int) and row["requests"] > 10
        assert 0.0 < row["hit_rate"] < 1.0  # type: ignore[operator]
        assert row["ttft_p95_s"] >= row["ttft_p50_s"] > 0  # type: ignore[operator]
    assert rows["vllm"]["demotions"] == 0 and rows["vllm"]["host_hit_tokens"] == 0
    everything = replay_stack(
        SLICE, "vllm", setup, latency, users=3, window=RunWindow(duration_s=400.0, warmup_s=0.0)
    )
    assert everything["requests"] > rows["vllm"]["requests"]  # type: ignore[operator]


def test_a_row_gives_gpu_seconds_per_session_and_memory_over_time() -> None:
    """GPU-seconds per session add up to the engines' busy time; HBM and host use are
    sampled every minute of the counted window, within 0..1, the host tier only where the
    stack has one."""
    setup, latency = make_setup(workers=2, hbm_gib=4, host_gib=8, block_size=64)
    window = RunWindow(duration_s=400.0, warmup_s=100.0)
    with_host = replay_stack(SLICE, "vllm-offload", setup, latency, users=3, window=window)
    no_host = replay_stack(SLICE, "vllm", setup, latency, users=3, window=window)
    usage = with_host["usage"]
    assert isinstance(usage, dict) and usage["every_s"] == 60.0
    assert usage["t_s"] == [120.0, 180.0, 240.0, 300.0, 360.0]  # the window's marks
    for name in ("hbm_held", "hbm_cached", "host_used"):
        assert len(usage[name]) == 5 and all(0.0 <= v <= 1.0 for v in usage[name])
    assert max(usage["hbm_cached"]) > 0.5  # the sessions' prefixes fill the 4 GiB pools
    assert with_host["host_used_max"] == max(usage["host_used"]) > 0
    assert no_host["host_used_mean"] is None and set(no_host["usage"]["host_used"]) == {None}  # type: ignore[index]
    gpu_s, per, p50 = (
        with_host[k] for k in ("gpu_s", "gpu_s_per_session", "gpu_s_per_session_p50")
    )
    assert isinstance(gpu_s, float) and isinstance(per, float) and isinstance(p50, float)
    assert p50 > 0 and 0 < per < gpu_s
    # per session: over those that ran to their end, not the ones the window's end cut off
    assert 0 < with_host["gpu_s_sessions"] * per < gpu_s  # type: ignore[operator]
    busy = with_host["gpu_busy_s"]
    assert isinstance(busy, float) and 0.95 * busy <= gpu_s <= busy * (1 + 1e-9)


def test_the_appliance_restores_host_copies_ahead_of_their_likely_turns() -> None:
    """Restore ahead of the predicted return: the reaper's wait model, learned from the
    answers, times a signal; a session whose prefix a worker gave back to the host tier by
    then is copied back to HBM, and its turn finds it there. Without it, nothing is."""
    setup, latency = make_setup(workers=1, hbm_gib=4, host_gib=8, block_size=64)
    window = RunWindow(duration_s=400.0, warmup_s=100.0)
    on = replay_stack(SLICE, "appliance-restore", setup, latency, users=3, window=window)
    off = replay_stack(SLICE, "appliance", setup, latency, users=3, window=window)
    assert STACKS["appliance-restore"].restore and not STACKS["appliance"].restore
    restores, used = on["restores"], on["restores_used"]
    assert isinstance(restores, int) and isinstance(used, int) and restores >= used >= 1
    summary = on["restore"]
    assert isinstance(summary, dict)
    assert summary["by_trigger"].keys() == {"hazard"}  # no client announces anything here
    assert summary["ttft_saved_s"] > 0 and "rows" not in summary
    restored, unused = on["restored_bytes"], on["restored_unused_bytes"]
    assert isinstance(restored, int) and isinstance(unused, int) and 0 <= unused < restored
    assert on["restored_unused_share"] == round(unused / restored, 4)
    assert summary["skipped"]["resident"] > 0  # most signals find the prefix in HBM
    assert [off[k] for k in ("restores", "restored_bytes", "restore")] == [None] * 3


def test_the_capacity_is_the_largest_count_within_the_slo() -> None:
    asked: list[int] = []

    def run(users: int) -> dict[str, object]:
        asked.append(users)
        return {"stack": "s", "ttft_p95_s": 0.1 * users}  # meets 2 s up to 20 users

    found, rows = capacity(run, 2.0, start=4, resolution=0.0)
    assert found == 20 and len(rows) == len(asked)
    assert asked[:5] == [4, 8, 16, 32, 64]  # doubling to two misses, then narrowing the gap
    assert asked[5] == 20  # where the line between 16 and 32 crosses the SLO
    assert capacity(lambda n: {"stack": "s", "ttft_p95_s": 9.0}, 2.0)[0] == 0
    linear = lambda n: {"stack": "s", "ttft_p95_s": 0.01 * n}  # noqa: E731
    coarse, steps = capacity(linear, 2.0)
    exact, all_steps = capacity(linear, 2.0, resolution=0.0)
    assert exact == 200 and 188 <= coarse <= 200
    assert len(steps) < len(all_steps)  # within 1/16 of it: fewer runs
    once, once_steps = capacity(linear, 2.0, confirm_misses=1)
    assert once == coarse and [r["ttft_p95_s"] for r in once_steps][:4] == [0.32, 0.64, 1.28, 2.56]
    assert len(once_steps) == len(steps) - 1  # no second miss at 512 users
    # A hockey stick: the crossing is found a quarter of the gap from either end at most.
    stick = lambda n: {"stack": "s", "ttft_p95_s": 1.0 if n <= 150 else 50.0}  # noqa: E731
    found, stick_steps = capacity(stick, 2.0, resolution=0.0)
    assert found == 150 and len(stick_steps) <= 5 + 12
    # A small count's miss (a few first turns make its p95) does not end the search.
    noisy = lambda n: {"stack": "s", "ttft_p95_s": 3.0 if n == 8 else 1.0 + n / 50}  # noqa: E731
    assert capacity(noisy, 2.0, start=4, resolution=0.0)[0] == 50
    assert capacity(noisy, 2.0, start=4, resolution=0.0, confirm_misses=1)[0] == 7  # 8 ends it


def test_a_capacity_search_from_a_count_that_misses_steps_down_to_one_that_meets() -> None:
    asked: list[int] = []

    def run(users: int) -> dict[str, object]:
        asked.append(users)
        return {"stack": "s", "ttft_p95_s": 1.0 if users <= 150 else 50.0}

    found, _ = capacity(run, 2.0, start=293, factor=1.25, resolution=1 / 16)
    assert asked[:4] == [293, 234, 187, 149]  # down by a quarter until one meets
    assert 141 <= found <= 150 and len(asked) <= 6  # doubling from 32 took 11 runs
    assert asked[4:] and all(149 < n < 187 for n in asked[4:])  # then within the bracket
    assert capacity(lambda n: {"stack": "s", "ttft_p95_s": 9.0}, 2.0, start=5)[0] == 0
    up: list[int] = []
    capacity(lambda n: up.append(n) or {"stack": "s", "ttft_p95_s": 0.0}, 2.0, limit=100)
    assert up == [32, 64]  # nothing past the limit


def test_the_search_starts_where_the_sessions_median_prompt_fills_the_box() -> None:
    setup, _ = make_setup(workers=2, hbm_gib=4, host_gib=8, block_size=64)
    fits = [r.input_tokens for s in SLICE for r in s.own_requests()]
    fits = sorted(n for n in fits if n < setup.max_model_len)
    median = fits[len(fits) // 2]
    hbm = 2 * setup.kv_blocks_per_worker * 64 // median
    assert first_count(SLICE, setup, host=False) == max(1, hbm)
    with_host = first_count(SLICE, setup, host=True)
    assert with_host == max(
        1, 2 * (setup.kv_blocks_per_worker + setup.host_blocks_per_worker) * 64 // median
    )
    assert with_host > first_count(SLICE, setup, host=False)
    twice, _ = make_setup(workers=4, hbm_gib=4, host_gib=8, block_size=64)
    assert first_count(SLICE, twice, host=True) in (2 * with_host, 2 * with_host + 1)


def test_the_ttft_floor_is_each_request_alone_with_its_previous_prompt_cached() -> None:
    _, latency = make_setup(workers=1, hbm_gib=8, block_size=64)
    ids = list(range(1, 101))
    s = trace(
        "a",
        req(6400, ids),
        req(6464, [*ids, 500], think=1.0),
        req(6528, [*ids, 500, 501], think=1.0),
    )
    floor = session_ttft_floor([s], latency, 16384)
    cold, warm = latency.prefill_s(6400, 0), latency.prefill_s(64, 6464)
    assert floor["p99_s"] == pytest.approx(cold, abs=1e-4)  # the first: nothing cached
    assert floor["p50_s"] == pytest.approx(warm, abs=1e-4)  # the rest: all but 64 tokens
    real = replay_stack(
        SLICE,
        "vllm",
        *make_setup(workers=1, hbm_gib=8, block_size=64),
        users=1,
        window=RunWindow(400.0, 0.0),
    )
    alone = session_ttft_floor(SLICE, latency, 16384)
    assert alone["p50_s"] <= real["ttft_p50_s"]  # type: ignore[operator]


def test_only_the_appliance_runs_its_workers_as_it_starts_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The anchors run vLLM's scheduler defaults, as shipped; the appliance (and the bound,
    which must stay above it) the settings it starts its own workers with: the step budget
    and its cap on a long prefill (what they do to a step: `test_sim_engine.py`, against
    vLLM's scheduler), and vLLM's priority scheduling."""
    ours = [n for n, s in STACKS.items() if s.appliance_workers]
    assert ours == ["appliance", "appliance-restore"]
    plain = dataclasses.replace(STACKS["appliance"], appliance_workers=False)
    monkeypatch.setitem(STACKS, "appliance-vllm-budget", plain)
    setup, latency = make_setup(workers=1, hbm_gib=8, host_gib=16, block_size=64)
    window = RunWindow(duration_s=600.0, warmup_s=0.0)
    rows = {
        name: replay_stack(SLICE, name, setup, latency, users=3, window=window)
        for name in ("appliance", "appliance-vllm-budget", "bound")
    }
    assert [r["appliance_workers"] for r in rows.values()] == [True, False, True]
    policies = [r["scheduling_policy"] for r in rows.values()]
    assert policies == ["priority", "fcfs", "priority"]
    budgets = [
        (r["max_num_batched_tokens"], r["long_prefill_token_threshold"]) for r in rows.values()
    ]
    ours_budget = (AGENT_BATCH_TOKENS, AGENT_PREFILL_CAP_TOKENS)
    assert budgets == [ours_budget, (setup.max_num_batched_tokens, 0), ours_budget]
    tuned, untuned = rows["appliance"], rows["appliance-vllm-budget"]
    assert tuned["ttft_p50_s"] != untuned["ttft_p50_s"]  # the same sessions, run otherwise


def test_only_the_appliances_stacks_end_a_session_whose_next_prompt_overflows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the appliance's reaper loop ends such a session live, its stacks (and the bound,
    which must stay above them) drop its own blocks on every tier; the anchors keep them,
    as vLLM does."""
    dropped: list[tuple[str, int]] = []
    release = SimEngine.release_session

    def seen(engine: SimEngine, session_id: str, own: Sequence[BlockHash], now: float) -> None:
        dropped.append((session_id, len(own)))
        release(engine, session_id, own, now)

    monkeypatch.setattr(SimEngine, "release_session", seen)
    over = trace("a", req(640, range(1, 11)), req(200_000, range(1, 3126)), req(700, range(1, 12)))
    setup, latency = make_setup(workers=1, hbm_gib=8, host_gib=16, block_size=64)
    window = RunWindow(duration_s=50.0, warmup_s=0.0)
    ended = {}
    for name in ("appliance", "appliance-restore", "bound", "llm-d", "vllm-offload"):
        dropped.clear()
        replay_stack([over], name, setup, latency, users=1, window=window)
        ended[name] = {(sid.split(":")[0] == "u0.1", n) for sid, n in dropped[:1]}
    ours = {(True, 10)}  # its first run drops its 10 blocks of its own
    assert ended == {
        "appliance": ours,
        "appliance-restore": ours,
        "bound": ours,
        "llm-d": set(),
        "vllm-offload": set(),
    }
