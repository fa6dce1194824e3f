"""The host tier in the replay: the bound at HBM + host capacity, a slice of the
conversation trace where host hits cut fresh prefill, the pooled-host row, and residency
policies whose DEMOTE and EVICT the replay carries out."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from appliance.perf.latency import LatencyModel
from appliance.perf.profile import bundled_profile
from appliance.policy.residency import HeldSession, IdleSession, ResidencyAction, ResidencyDecision
from appliance.replay import render_table, run_replay
from appliance.replay.bounds import block_keys, compute_bounds, optimal
from appliance.replay.kv_residency.residency import PolicyResidency
from appliance.replay.runner import make_setup, replay_policy
from appliance.replay.traces import load_trace
from appliance.sim.kv.host_tier import HostSession
from tests.paths import MOONCAKE

BLOCK = 512


def write_trace(path: Path, rows: list[tuple[float, list[int], int]]) -> Path:
    lines = [
        {"timestamp": int(t * 1000), "input_length": n, "output_length": 1, "hash_ids": ids}
        for t, ids, n in rows
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


# --- the bound ---


def test_the_host_bound_is_belady_over_hbm_plus_host_and_only_with_a_host_tier() -> None:
    trace = load_trace(MOONCAKE, limit=400)
    keys = block_keys(trace, BLOCK)
    prompts = [r.input_length for r in trace.records]
    plain = compute_bounds(trace, BLOCK, 100, keys)
    with_host = compute_bounds(trace, BLOCK, 100, keys, host_blocks=300)
    assert "optimal_with_host" not in plain
    assert with_host["optimal"] == plain["optimal"]
    assert with_host["optimal_with_host"] == optimal(prompts, keys, BLOCK, 400)
    more = with_host["optimal_with_host"].fresh_prefill_tokens
    assert with_host["unbounded"].fresh_prefill_tokens <= more
    assert more < plain["optimal"].fresh_prefill_tokens


# --- a slice of the conversation trace ---

SLICE = {
    "policies": ["session-hash"],
    "workers": 8,
    "hbm_gib": 4.0,  # 64 blocks of 512 per worker: the GPUs turn over within the slice
    "limit": 400,
}


@pytest.fixture(scope="module")
def hbm_only() -> dict:
    return run_replay(MOONCAKE, **SLICE)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def with_host() -> dict:
    return run_replay(MOONCAKE, host_gib=16.0, **SLICE)  # type: ignore[arg-type]


def test_host_hits_cut_fresh_prefill(hbm_only: dict, with_host: dict) -> None:
    before = hbm_only["policies"]["session-hash"]
    after = with_host["policies"]["session-hash"]
    assert before["host_hit_tokens"] == 0 and after["host_hit_tokens"] > 0
    assert after["fresh_prefill_tokens"] < before["fresh_prefill_tokens"]
    # Fresh prefill falls by exactly what the host tier served and the GPU did not.
    gained = before["fresh_prefill_tokens"] - after["fresh_prefill_tokens"]
    assert gained == after["cached_tokens"] - before["cached_tokens"]
    assert after["host_load_s"] > 0 and after["host_stored_blocks"] > 0
    assert after["requests"] == before["requests"]


def test_the_report_adds_the_host_bound_and_a_pooled_host_row(with_host: dict) -> None:
    setup = with_host["setup"]
    assert setup["host_blocks_per_worker"] == 256 and setup["host_gib_per_worker"] == 16.0
    bound = with_host["bounds"]["optimal_with_host"]
    assert bound["capacity_blocks"] == 8 * (64 + 256)
    rows = with_host["policies"]
    assert list(rows) == ["session-hash", "session-hash+pooled-host"]
    own = rows["session-hash"]
    assert own["vs_optimal_with_host"] == pytest.approx(
        own["fresh_prefill_tokens"] / bound["fresh_prefill_tokens"], abs=1e-4
    )
    gain = with_host["pooled_host_gain"]["session-hash+pooled-host"]
    pooled = rows["session-hash+pooled-host"]
    assert gain["versus"] == "session-hash"
    assert gain["fresh_prefill_saved_tokens"] == (
        own["fresh_prefill_tokens"] - pooled["fresh_prefill_tokens"]
    )
    table = render_table(with_host)
    assert "host Mtok" in table and "optimal_with_host" in table and "+ 16.0 GiB host" in table


def test_without_a_host_tier_the_report_has_no_host_columns(hbm_only: dict) -> None:
    assert "optimal_with_host" not in hbm_only["bounds"]
    assert "pooled_host_gain" not in hbm_only
    assert "host Mtok" not in render_table(hbm_only)


# --- residency policies that demote or evict ---


@dataclass(frozen=True)
class Always:
    """A residency policy that does one thing to every finished turn."""

    action: ResidencyAction
    name: str = "always"

    def decide(self, session: IdleSession, now: float) -> ResidencyDecision:
        return ResidencyDecision(self.action, f"always {self.action.value}")

    def priority(self, held: HeldSession, now: float) -> float:
        return held.held_since_s


@pytest.fixture(scope="module")
def tool_wait(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One worker of 16 blocks (test_replay_residency's trace): A's first turn (3 full
    blocks and a partial one) at t=0, B's at t=2, C's 12 blocks at t=4, A's next turn
    re-sending A's 3 full blocks at t=8. Under LRU, C leaves A only its first block on the
    GPU."""
    return write_trace(
        tmp_path_factory.mktemp("host") / "tool_wait.jsonl",
        [
            (0.0, [1, 2, 3, 4], 4 * BLOCK - 100),
            (2.0, [11, 12, 13, 14], 4 * BLOCK - 100),
            (4.0, list(range(21, 33)), 12 * BLOCK - 100),
            (8.0, [1, 2, 3, 5, 6], 5 * BLOCK - 100),
        ],
    )


def replayed(trace: Path, residency: object, host_gib: float = 2.0) -> dict[str, object]:
    """The trace on one worker of 16 blocks with `host_gib` (2.0: 32 blocks, room for all)."""
    setup, latency = make_setup(workers=1, hbm_gib=1.0, host_gib=host_gib)
    return replay_policy(
        load_trace(trace),
        "round-robin",
        setup,
        latency,
        residency=residency,  # type: ignore[arg-type]
    )


def test_with_lru_a_host_tier_serves_what_the_gpu_lost(tool_wait: Path) -> None:
    m = replayed(tool_wait, "lru")
    # A's first block is still on the GPU; its 2nd and 3rd come back from the host tier.
    assert m["cached_tokens"] == 3 * BLOCK and m["host_hit_tokens"] == 2 * BLOCK


def test_a_policy_that_demotes_sends_every_turn_to_host(tool_wait: Path) -> None:
    m = replayed(tool_wait, Always(ResidencyAction.DEMOTE))
    # A's blocks left the GPU when its turn ended: all 3 come back from the host tier.
    assert m["cached_tokens"] == 3 * BLOCK and m["host_hit_tokens"] == 3 * BLOCK
    assert m["demotions"] == 4 and m["residency_by_action"] == {"demote": 4}
    assert m["residency_by_reason"] == {"always demote": 4}


def test_a_policy_that_evicts_puts_every_turn_first_in_line(tool_wait: Path) -> None:
    m = replayed(tool_wait, Always(ResidencyAction.EVICT), host_gib=0.0)
    # B's and A's blocks went first for C: nothing of A is left (LRU kept its first block).
    assert m["cached_tokens"] == 0
    assert m["evictions"] == 4 and m["residency_by_action"] == {"evict": 4}


def test_demoting_without_a_host_tier_is_refused(tool_wait: Path) -> None:
    with pytest.raises(ValueError, match="no host tier"):
        replayed(tool_wait, Always(ResidencyAction.DEMOTE), host_gib=0.0)


@dataclass(frozen=True)
class Hosted(Always):
    """With a host order: the session with the most tokens on host goes first."""

    def host_priority(self, held: HeldSession, now: float) -> float:
        return -held.resident_tokens


def test_a_policy_with_a_host_order_ranks_the_host_tier() -> None:
    latency = LatencyModel.from_profile(bundled_profile())
    plain = PolicyResidency(Always(ResidencyAction.RELEASE), latency=latency, block_size=BLOCK)
    assert plain.host_priority is None  # LRU, as vLLM's
    ranked = PolicyResidency(Hosted(ResidencyAction.RELEASE), latency=latency, block_size=BLOCK)
    rank = ranked.host_priority
    assert rank is not None
    assert rank(HostSession("s", 3, 1.0), 2.0) == -3 * BLOCK
    assert rank(HostSession("s", 3, 1.0), 2.0) < rank(HostSession("t", 1, 5.0), 2.0)
