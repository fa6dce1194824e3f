"""Where a stack's TTFT p95 goes: the requests that set it, their time split by cause."""

from __future__ import annotations

import pytest

from appliance.perf.latency import CopyDirection, LatencyModel
from appliance.perf.profile import bundled_profile
from appliance.replay.bounds import prefill_alone_s
from appliance.replay.sessions.ttft_at_p95 import LONG_PREFILL_TOKENS, ttft_at_p95
from appliance.sim.runtime.virtual import RequestRecord

LATENCY = LatencyModel.from_profile(bundled_profile())


def record(i: int, ttft: float, prompt: int, cached: int, host: int = 0) -> RequestRecord:
    return RequestRecord(
        f"r{i}",
        0,
        100.0,
        prompt,
        first_token_s=100.0 + ttft,
        cached_tokens=cached,
        host_cached_tokens=host,
    )


def test_with_no_cap_a_prefill_is_one_pass_and_nothing_is_chunking() -> None:
    quick = [record(i, 0.2, 50_000, 49_000) for i in range(19)]
    out = ttft_at_p95([*quick, record(19, 2.0, 109_000, 100_000)], LATENCY, 0)
    assert out["requests"] == 1 and out["chunking_s"] == 0.0
    assert out["own_prefill_s"] == pytest.approx(LATENCY.prefill_s(9000, 100_000), abs=1e-4)


def test_the_requests_within_the_band_of_the_p95_split_into_their_causes() -> None:
    quick = [record(i, 0.2, 50_000, 49_000) for i in range(37)]
    slow_hit = record(37, 3.0, 110_000, 100_000, host=60_000)
    compacted = record(38, 2.8, 30_000, 2_000)
    first_turn = record(39, 9.0, 100_000, 0)  # far over the p95: not what sets it
    out = ttft_at_p95([*quick, slow_hit, compacted, first_turn], LATENCY, 4096)
    assert out["requests"] == 2  # the p95 of 40 (rank 38 from 0) is 3.0 s; 2.8 is within 10 %
    own = [LATENCY.prefill_s(10_000, 100_000), LATENCY.prefill_s(28_000, 2_000)]
    cut = [
        prefill_alone_s(LATENCY, 110_000, 100_000, 4096),
        prefill_alone_s(LATENCY, 30_000, 2_000, 4096),
    ]
    host = LATENCY.kv_copy_s(60_000, CopyDirection.H2D)
    assert out["own_prefill_s"] == pytest.approx(sum(own) / 2, abs=1e-4)
    assert out["chunking_s"] == pytest.approx((sum(cut) - sum(own)) / 2, abs=1e-4)
    assert out["host_load_s"] == pytest.approx(host / 2, abs=1e-4)
    assert out["waiting_s"] == pytest.approx((5.8 - sum(cut) - host) / 2, abs=1e-4)
    assert out["long_prefill_share"] == 0.5  # the compacted prompt's 28k; the hit's 10k is not
    assert 10_000 < LONG_PREFILL_TOKENS < 28_000


def test_no_timed_request_leaves_every_figure_empty() -> None:
    unanswered = RequestRecord("r0", 0, 1.0, 100)
    assert set(ttft_at_p95([unanswered], LATENCY, 4096).values()) == {None}
    assert ttft_at_p95([], LATENCY, 4096)["requests"] is None
