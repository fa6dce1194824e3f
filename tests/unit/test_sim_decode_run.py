"""Plain decode steps run with their outputs held (`sim/core/decode_run.py`, the virtual driver's
fast path): a replay with it ends exactly as one that steps each alone, on scripted
workloads (small blocks, stops, the model's length, both policies, a host tier, pins) and
on the vendored recorded sessions through every stack and the bound."""

from __future__ import annotations

import functools
import random
from collections import Counter
from typing import Any

import pytest

from appliance.domain.block_hash import BlockHasher, HashAlgo
from appliance.perf.latency import LatencyModel
from appliance.perf.profile import bundled_profile
from appliance.replay.runner import make_setup
from appliance.replay.sessions import session_replay
from appliance.replay.sessions.run_window import RunWindow
from appliance.replay.sessions.session_replay import BOUND, STACKS, replay_stack
from appliance.sim.core.engine import SimEngine
from appliance.sim.core.engine_config import EngineConfig
from appliance.sim.engine_io import SimRequest, StepResult
from appliance.sim.kv.host_tier import HostTier
from appliance.sim.kv.pins import Pin
from appliance.sim.kv.residency_hook import AfterTurn, PinDue, TurnEnd
from appliance.sim.runtime.engine_views import session_hash
from appliance.sim.runtime.virtual import Arrival, ReplayResult, replay
from appliance.workload.agent_traces import read_agent_sessions
from tests.paths import DATA

LAT = LatencyModel.from_profile(bundled_profile())


class _Hold:
    """Holds every finished turn's blocks 2 s (pins fall due between steps), then demotes
    them to the host tier."""

    def after_turn(self, end: TurnEnd) -> AfterTurn:
        return AfterTurn("hold", end.now_s + 2.0)

    def revisit(self, due: PinDue) -> AfterTurn:
        return AfterTurn("demote")

    def pin_priority(self, pin: Pin, now: float) -> float:
        return -pin.until_s


def _engines(n: int, *, host: bool, hold: bool, **kw: Any) -> list[SimEngine]:
    args: dict[str, Any] = {
        "num_blocks": 400,
        "block_size": 16,
        "max_model_len": 1024,
        "max_num_batched_tokens": 512,
        "max_num_seqs": 12,
        **kw,
    }
    config = EngineConfig(**args)
    hasher = BlockHasher(HashAlgo.SHA256, config.block_size)
    return [
        SimEngine(
            config,
            hasher=hasher,
            latency=LAT,
            host=HostTier(200) if host else None,
            residency=_Hold() if hold else None,
        )
        for _ in range(n)
    ]


def _workload(seed: int, n: int = 160) -> list[Arrival]:
    """Sessions re-sending their growing history; some stop early, some reach the length."""
    rng = random.Random(seed)
    histories: dict[str, list[int]] = {}
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(1.5)
        sid = f"s{rng.randrange(12)}"
        hist = histories.setdefault(sid, [rng.randrange(32000) for _ in range(40)])
        hist += [rng.randrange(32000) for _ in range(rng.randrange(5, 200))]
        del hist[900:]
        eos = rng.choice([None, rng.randrange(1, 60)])
        req = SimRequest(
            f"r{i}",
            list(hist),
            rng.randrange(1, 300),
            ignore_eos=eos is None,
            session_id=sid,
            priority=rng.randrange(3),
            arrival_s=t,
            eos_after=eos,
        )
        out.append(Arrival(t, req))
    return out


def _run(fast: bool, seed: int, **kw: Any) -> tuple[ReplayResult, Counter[str], int]:
    tokens: Counter[str] = Counter()
    calls = [0]

    def on_step(i: int, now: float, result: StepResult) -> None:
        calls[0] += 1
        for out in result.outputs:
            tokens[out.request_id] += len(out.new_token_ids)

    result = replay(
        _engines(3, **kw), _workload(seed), session_hash(), on_step=on_step, fast_decode=fast
    )
    return result, tokens, calls[0]


@pytest.mark.parametrize(
    ("policy", "host", "hold", "blocks"),
    [("fcfs", False, False, 400), ("priority", False, False, 70), ("fcfs", True, True, 120)],
)
def test_a_workload_replays_the_same_with_held_decode_steps(
    policy: str, host: bool, hold: bool, blocks: int
) -> None:
    kw = {"host": host, "hold": hold, "policy": policy, "num_blocks": blocks}
    fast, fast_tokens, fast_calls = _run(True, 5, **kw)
    slow, slow_tokens, slow_calls = _run(False, 5, **kw)
    assert fast.records == slow.records
    assert fast.engine_stats == slow.engine_stats
    assert (fast.end_s, fast.num_steps) == (slow.end_s, slow.num_steps)
    assert fast_tokens == slow_tokens
    assert slow_calls == slow.num_steps
    assert fast_calls < slow_calls, "some steps should be plain decode steps"
    reasons = Counter(r.finish_reason for r in fast.records)
    assert reasons["stop"] and reasons["length"]
    preempted = sum(s.num_preemptions_total for s in fast.engine_stats)
    assert preempted > 0 or blocks == 400, "a short cache should preempt"
    if hold:
        assert sum(s.pins_total for s in fast.engine_stats) > 0
        assert sum(s.demotions_total for s in fast.engine_stats) > 0


SLICE = read_agent_sessions(DATA / "kvct")


def _spy(*args: Any, seen: list[ReplayResult], **kw: Any) -> ReplayResult:
    seen.append(replay(*args, **kw))
    return seen[-1]


_WATCHED = (
    "usage",
    "hbm_held_mean",
    "hbm_held_max",
    "hbm_cached_mean",
    "hbm_cached_max",
    "host_used_mean",
    "host_used_max",
    "gpu_s",
    "gpu_s_per_session",
    "gpu_s_per_session_p50",
)


@pytest.mark.parametrize("stack", [*STACKS, BOUND])
def test_the_recorded_sessions_replay_the_same_with_held_decode_steps(
    stack: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup, latency = make_setup(workers=2, hbm_gib=8, host_gib=8, block_size=64)
    window = RunWindow(duration_s=400.0, warmup_s=100.0)
    runs: dict[bool, tuple[dict[str, object], ReplayResult]] = {}
    seen: list[ReplayResult] = []
    for fast in (True, False):
        spy = functools.partial(_spy, seen=seen, fast_decode=fast)
        monkeypatch.setattr(session_replay, "replay", spy)
        row = replay_stack(SLICE, stack, setup, latency, users=4, window=window)
        row.pop("wall_s")
        for name in _WATCHED:  # an on_step watcher's: sampled as runs of steps are handed over
            row.pop(name)
        runs[fast] = (row, seen[-1])
    (fast_row, held), (slow_row, alone) = runs[True], runs[False]
    assert fast_row == slow_row
    assert held.records == alone.records
    assert held.engine_stats == alone.engine_stats
    assert held.num_steps == alone.num_steps


def test_held_outputs_must_be_taken_before_the_next_full_step() -> None:
    (engine,) = _engines(1, host=False, hold=False)
    engine.add_request(SimRequest("a", list(range(20)), 8), 0.0)
    engine.step(0.0)  # the prefill: 20 tokens, the first sampled
    assert engine.decode_step(1.0) is not None
    with pytest.raises(RuntimeError, match="take_decoded"):
        engine.step(2.0)
    result = engine.take_decoded(1)
    assert result.scheduled == {"a": 1} and len(result.outputs[0].new_token_ids) == 1
    with pytest.raises(ValueError, match="cannot take"):
        engine.take_decoded(1)
    plain = 0
    while engine.decode_step(3.0) is not None:
        plain += 1
    # 2 of 8 tokens generated: 5 more plain steps; the next generates the 8th and finishes.
    assert plain == 5 and engine.take_decoded(5).num_scheduled_tokens == 5
    (out,) = engine.step(4.0).outputs
    assert len(out.new_token_ids) == 1 and out.finish_reason == "length"
