"""The idle reaper over the simulated engine's host tier (the H200 profile), in virtual time:
what `appliance replay --residency reaper --host-gib` runs. A live `appliance up --engine
sim` has no host tier yet (docs/engines.md), so this is where a demotion can be seen.

Two sessions of 2,000 tokens end their turns on one worker of 512 blocks of 16 (8,192
tokens) with a host tier of 4,096 blocks, and a flood of last-step prompts, 1.5 times the
pool, follows. Session A waits on a build (about 20 s): the reaper demotes it, its GPU
blocks go first and its host copy stays. Session B waits on an api call (about 1 s): the
reaper holds it on the GPU. Both come back with 30 new tokens. A's blocks are promoted:
all its prefix is cached, from the host tier, and its time to first token is the copy
back at the profile's host-to-device speed plus the prefill of its new tokens, so it is
longer than B's by the promotion time, and far shorter than a re-prefill of its prefix.
Without a host tier nothing is demoted: the reaper holds A on the GPU instead.
"""

from __future__ import annotations

import random

import pytest

from appliance.domain.block_hash import BlockHasher, HashAlgo
from appliance.perf.latency import CopyDirection, LatencyModel
from appliance.perf.profile import bundled_profile
from appliance.policy.reaper import Reaper, ReaperTuning
from appliance.policy.wait_curves import LogNormal
from appliance.replay.kv_residency.residency import PolicyResidency, TurnHint
from appliance.sim.core.engine import EngineConfig, SimEngine
from appliance.sim.engine_io import SimRequest
from appliance.sim.kv.host_tier import HostTier
from appliance.sim.runtime.virtual import Arrival, RequestRecord, replay

BS = 16
POOL_BLOCKS = 512
HOST_BLOCKS = 4096
PREFIX = 2000
NEW = 30
LATENCY = LatencyModel.from_profile(bundled_profile())
PRIORS = {
    "api": LogNormal.from_median_p95(1.0, 3.0),
    "build": LogNormal.from_median_p95(20.0, 60.0),
}
HINTS = {
    "a1": TurnHint(True, "build", 20.0),
    "b1": TurnHint(True, "api", 1.0),
}
"""What the client said of each turn; the flood and the returns end in no tool call."""


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(30_000) for _ in range(n)]


def flood(i: int) -> Arrival:
    """A last-step prompt of another session, 1,000 tokens."""
    return Arrival(
        0.2 + 0.05 * i, SimRequest(f"f{i}", prompt(100 + i, 1000), 1, session_id=f"F{i}")
    )


def run(host_blocks: int) -> tuple[dict[str, RequestRecord], PolicyResidency, SimEngine]:
    residency = PolicyResidency(
        Reaper(priors=PRIORS, tuning=ReaperTuning(pressure_from=0.0)),
        latency=LATENCY,
        block_size=BS,
        hints=lambda rid: HINTS.get(rid, TurnHint(False)),
    )
    engine = SimEngine(
        EngineConfig(num_blocks=POOL_BLOCKS + 1, block_size=BS, max_model_len=4096),
        hasher=BlockHasher(HashAlgo.SHA256, BS),
        latency=LATENCY,
        residency=residency,
        host=HostTier(host_blocks) if host_blocks else None,
    )
    a, b = prompt(1, PREFIX), prompt(2, PREFIX)
    arrivals = [
        Arrival(0.0, SimRequest("a1", a, 1, session_id="A")),
        Arrival(0.0, SimRequest("b1", b, 1, session_id="B")),
        *(flood(i) for i in range(12)),  # 12,000 tokens: 1.5 times the pool
        Arrival(1.5, SimRequest("b2", b + prompt(3, NEW), 1, session_id="B")),
        Arrival(20.0, SimRequest("a2", a + prompt(4, NEW), 1, session_id="A")),
    ]
    records = {r.request_id: r for r in replay([engine], arrivals).records}
    return records, residency, engine


def ttft(record: RequestRecord) -> float:
    assert record.ttft_s is not None
    return record.ttft_s


def test_a_demoted_session_comes_back_promoted_with_the_copy_in_its_ttft() -> None:
    records, residency, engine = run(HOST_BLOCKS)
    assert residency.by_tool[("build", "demote")] == 1, residency.by_tool
    assert residency.by_tool[("api", "hold")] == 1 and residency.by_tool[("api", "demote")] == 0
    a2, b2 = records["a2"], records["b2"]
    whole = PREFIX // BS * BS  # the full blocks of the prefix
    assert (a2.cached_tokens, a2.host_cached_tokens) == (whole, whole)
    assert (b2.cached_tokens, b2.host_cached_tokens) == (whole, 0)
    promote_s = LATENCY.kv_copy_s(whole, CopyDirection.H2D)
    prefill_s = LATENCY.prefill_s(PREFIX + NEW - whole, whole)
    print(
        f"A (demoted): {a2.host_cached_tokens} tokens promoted, TTFT {ttft(a2) * 1e3:.1f} ms "
        f"(copy {promote_s * 1e3:.1f} ms + prefill {prefill_s * 1e3:.1f} ms); "
        f"B (held): TTFT {ttft(b2) * 1e3:.1f} ms; a re-prefill of A: "
        f"{LATENCY.prefill_s(PREFIX + NEW) * 1e3:.1f} ms"
    )
    assert ttft(a2) >= promote_s
    assert ttft(a2) == pytest.approx(promote_s + prefill_s, rel=1e-6)
    assert ttft(b2) == pytest.approx(prefill_s, rel=1e-6)
    assert ttft(a2) - ttft(b2) == pytest.approx(promote_s, rel=1e-6)
    assert ttft(a2) < LATENCY.prefill_s(PREFIX + NEW) / 2
    assert engine.stats.demotions_total == 1
    assert engine.stats.host_load_s_total == pytest.approx(promote_s)


def test_without_a_host_tier_the_reaper_holds_it_on_the_gpu_instead() -> None:
    records, residency, engine = run(0)
    assert residency.actions["demote"] == 0 and engine.stats.demotions_total == 0
    assert residency.by_tool[("build", "hold")] >= 1, residency.by_tool
    a2 = records["a2"]
    whole = PREFIX // BS * BS
    assert (a2.cached_tokens, a2.host_cached_tokens) == (whole, 0)
    assert ttft(a2) == pytest.approx(LATENCY.prefill_s(PREFIX + NEW - whole, whole), rel=1e-6)
