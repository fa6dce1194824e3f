"""The GPU profile loader and the latency model fitted to it, against the H200 figures."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.domain.errors import ConfigError
from appliance.perf.latency import CopyDirection, LatencyModel
from appliance.perf.profile import (
    DEFAULT_PROFILE,
    DEFAULT_WEIGHTS_BYTES,
    ENGINE_START_S,
    RELOAD_BYTES_PER_S,
    DecodePoint,
    PrefillPoint,
    bundled_profile,
    bundled_profile_names,
    load_profile,
    parse_profile,
)

DATA = Path(__file__).resolve().parents[2] / "appliance" / "data" / f"{DEFAULT_PROFILE}.json"
RAW: dict[str, Any] = json.loads(DATA.read_text())
H200 = bundled_profile()
MODEL = LatencyModel.from_profile(H200)
GIB = 1 << 30


def test_bundled_profile_is_the_h200_calibration() -> None:
    assert DEFAULT_PROFILE in bundled_profile_names()
    assert H200.gpu == "NVIDIA H200"
    assert H200.kv_bytes_per_token == 131_072
    assert H200.memory_bytes == 150_754_820_096
    assert H200.d2d_gbps == pytest.approx(4237.44, rel=1e-4)
    full = [(p.fresh_tokens, p.seconds) for p in H200.prefill if p.reused_tokens == 0]
    assert [n for n, _ in full] == [512, 2048, 8192, 32768]
    incremental = [p for p in H200.prefill if p.reused_tokens]
    assert [(p.fresh_tokens, p.reused_tokens) for p in incremental] == [(512, 8192), (512, 32768)]
    assert {(p.batch_size, p.context_tokens) for p in H200.decode} == {
        (1, 4096),
        (1, 8192),
        (1, 32768),
        (8, 4096),
        (32, 4096),
    }
    assert [c.nbytes for c in H200.copies] == [2 * 2**20, 64 * 2**20, GIB]


# --- prefill ---


def test_cold_32k_prompt_takes_about_1_4_s() -> None:
    assert MODEL.prefill_s(32_768) == pytest.approx(1.404, rel=0.10)


@pytest.mark.parametrize("point", [p for p in H200.prefill], ids=repr)
def test_prefill_reproduces_every_measured_point(point: PrefillPoint) -> None:
    got = MODEL.prefill_s(point.fresh_tokens, point.reused_tokens)
    assert got == pytest.approx(point.seconds, rel=0.10)


def test_32k_prompt_with_all_but_512_tokens_cached_is_under_100ms() -> None:
    assert MODEL.prefill_s(512, 32_768 - 512) < 0.100
    assert MODEL.prefill_s(512, 32_768 - 512) > MODEL.prefill_s(512)  # context still costs


@given(total=st.integers(2, 131_072), data=st.data())
def test_a_cache_hit_always_shortens_the_prefill(total: int, data: st.DataObject) -> None:
    c1 = data.draw(st.integers(0, total - 1))
    c2 = data.draw(st.integers(c1, total - 1))
    # Same prompt, more of it reused: never slower; reusing something: faster than cold.
    assert MODEL.prefill_s(total - c2, c2) <= MODEL.prefill_s(total - c1, c1)
    if c2 > 0:
        assert MODEL.prefill_s(total - c2, c2) < MODEL.prefill_s(total)


@given(fresh=st.integers(1, 65_536), reused=st.integers(0, 65_536), more=st.integers(1, 4096))
def test_prefill_grows_with_fresh_tokens_and_with_context(
    fresh: int, reused: int, more: int
) -> None:
    base = MODEL.prefill_s(fresh, reused)
    assert MODEL.prefill_s(fresh + more, reused) > base
    assert MODEL.prefill_s(fresh, reused + more) >= base


def test_a_hit_costs_what_an_earlier_chunk_would() -> None:
    """prefill(fresh=n, reused=c) is one function: a cache hit of c tokens and a first chunk
    of c tokens leave the same remaining work, and chunking adds only per-chunk overhead."""
    prompt, hit = 32_768, 8_192
    with_hit = MODEL.prefill_s(prompt - hit, hit)
    second_chunk = MODEL.prefill_s(prompt - hit, reused_tokens=hit)
    assert with_hit == second_chunk
    chunks = sum(MODEL.prefill_s(8_192, c) for c in range(0, prompt, 8_192))
    assert chunks == pytest.approx(MODEL.prefill_s(prompt), rel=0.10)
    assert MODEL.prefill_s(0, 4096) == 0.0


# --- decode ---


@pytest.mark.parametrize(
    ("batch", "measured"),
    [(1, 0.02527), (8, 0.03113), (32, 0.06665)],
)
def test_decode_step_slows_with_batch_as_measured_at_4k(batch: int, measured: float) -> None:
    assert MODEL.decode_step_s(batch, batch * 4096) == pytest.approx(measured, rel=0.10)


@pytest.mark.parametrize("point", [p for p in H200.decode], ids=repr)
def test_decode_reproduces_every_measured_point(point: DecodePoint) -> None:
    got = MODEL.decode_step_s(point.batch_size, point.batch_size * point.context_tokens)
    assert got == pytest.approx(point.seconds, rel=0.10)


@given(batch=st.integers(1, 256), ctx=st.integers(0, 1 << 20), more=st.integers(1, 64))
def test_decode_step_grows_with_batch_and_context(batch: int, ctx: int, more: int) -> None:
    step = MODEL.decode_step_s(batch, ctx)
    assert MODEL.decode_step_s(batch + more, ctx) > step
    assert MODEL.decode_step_s(batch, ctx + more * 1000) > step
    assert MODEL.decode_step_s(0, ctx) == 0.0


def test_decode_reads_every_context_token_at_hbm_speed_at_least() -> None:
    per_token = MODEL.decode.per_context_token_s
    assert per_token >= H200.kv_bytes_per_token / (H200.d2d_gbps * 1e9) * 0.999  # type: ignore[operator]


# --- copies ---


def test_kv_bytes_per_token_from_the_profile() -> None:
    assert MODEL.kv_bytes(32_768) == 4 * GIB
    assert MODEL.kv_bytes(-1) == 0


@pytest.mark.parametrize("direction", [CopyDirection.H2D, CopyDirection.D2H])
def test_a_32k_session_moves_in_about_78ms_as_one_copy(direction: CopyDirection) -> None:
    assert MODEL.kv_copy_s(32_768, direction) == pytest.approx(0.078, rel=0.10)


@pytest.mark.parametrize(
    ("entry", "direction"),
    [(e, d) for e in ("block16", "mb64", "gb1") for d in ("h2d", "d2h")],
)
def test_copy_reproduces_measured_bandwidths(entry: str, direction: str) -> None:
    nbytes = RAW["copy_gbps"][entry]["bytes"]
    seconds = nbytes / (RAW["copy_gbps"][entry][direction] * 1e9)
    assert MODEL.copy_s(nbytes, CopyDirection(direction)) == pytest.approx(seconds, rel=0.01)


def test_block_by_block_host_to_gpu_is_far_slower_than_one_batched_copy() -> None:
    batched = MODEL.kv_copy_s(32_768, CopyDirection.H2D)
    per_block = MODEL.kv_copy_s(32_768, CopyDirection.H2D, tokens_per_copy=16)
    assert per_block > 10 * batched
    assert MODEL.copy_s(1000, CopyDirection.H2D) > 0.001  # the fixed cost of a small copy
    assert MODEL.copy_s(2 * 2**20, CopyDirection.H2D, copies=3) == pytest.approx(
        3 * MODEL.copy_s(2 * 2**20, CopyDirection.H2D)
    )


@given(n=st.integers(1, 1 << 36), more=st.integers(1, 1 << 30))
def test_copies_take_longer_with_more_bytes(n: int, more: int) -> None:
    for direction in CopyDirection:
        assert MODEL.copy_s(n + more, direction) >= MODEL.copy_s(n, direction) > 0


def test_device_to_device_counts_read_and_write() -> None:
    assert MODEL.copy_s(4 * GIB, CopyDirection.D2D) == pytest.approx(
        2 * 4 * GIB / (H200.d2d_gbps * 1e9)  # type: ignore[operator]
    )


# --- the data is data ---


def test_another_gpu_file_changes_every_figure() -> None:
    raw = copy.deepcopy(RAW)
    for table in ("full_prefill_s", "incremental_prefill_s", "decode_step_s"):
        raw[table] = {k: 2 * v for k, v in raw[table].items()}
    raw["batched_decode_step_s"] = {k: 2 * v for k, v in raw["batched_decode_step_s"].items()}
    raw["model"]["kv_bytes_per_token"] = 65_536
    slow = LatencyModel.from_profile(parse_profile(raw, name="slow"))
    assert slow.prefill_s(32_768) == pytest.approx(2 * MODEL.prefill_s(32_768), rel=0.02)
    assert slow.prefill_s(512, 32_256) == pytest.approx(2 * MODEL.prefill_s(512, 32_256), rel=0.1)
    assert slow.decode_step_s(8, 8 * 4096) == pytest.approx(0.0623, rel=0.10)
    assert slow.kv_bytes(32_768) == 2 * GIB


def test_grid_points_and_the_recorded_fresh_count_are_used() -> None:
    raw = copy.deepcopy(RAW)
    raw["incremental_prefill_fresh_tokens"] = 256
    raw["grid_prefill_s"] = {"ctx0_fresh64": 0.01, "ctx2048_fresh1024": 0.05}
    raw["grid_decode_step_s"] = {"B4_ctx1024": 0.026, "B64_ctx8192": 0.2}
    profile = parse_profile(raw)
    assert PrefillPoint(256, 8192, RAW["incremental_prefill_s"]["8192"]) in profile.prefill
    assert PrefillPoint(64, 0, 0.01) in profile.prefill
    assert PrefillPoint(1024, 2048, 0.05) in profile.prefill
    assert DecodePoint(64, 8192, 0.2) in profile.decode
    model = LatencyModel.from_profile(profile)
    assert model.decode_step_s(64, 64 * 8192) == pytest.approx(0.2, rel=0.10)


def test_a_sparse_profile_still_fits() -> None:
    raw = {
        "device": "cuda",
        "model": {"kv_bytes_per_token": 1000},
        "full_prefill_s": {"1000": 0.1, "4000": 0.4},
        "decode_step_s": {"1000": 0.02},
        "copy_gbps": {"one": {"bytes": 10**6, "h2d": 1.0, "d2h": 2.0}},
    }
    model = LatencyModel.from_profile(parse_profile(raw))
    assert model.prefill_s(2000) == pytest.approx(0.2, rel=1e-6)  # linear through 2 points
    assert model.prefill_s(1000, 1000) < model.prefill_s(2000)
    assert model.decode_step_s(4, 4000) == pytest.approx(0.02)  # one batch size: flat
    assert model.copy_s(10**6, CopyDirection.H2D) == pytest.approx(0.001)
    with pytest.raises(ValueError, match="device-to-device"):
        model.copy_s(10, CopyDirection.D2D)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.pop("model"), "kv_bytes_per_token"),
        (lambda r: r.update(full_prefill_s={}), "full_prefill_s"),
        (lambda r: r.update(decode_step_s={}, batched_decode_step_s={}), "decode_step_s"),
        (lambda r: r.update(copy_gbps={}), "copy_gbps"),
        (lambda r: r["full_prefill_s"].update({"512": "error: OOM"}), "positive number"),
        (lambda r: r["batched_decode_step_s"].update({"B8": 0.1}), "B<N>_ctx<N>"),
        (lambda r: r["full_prefill_s"].update({"many": 0.1}), "token count"),
    ],
)
def test_broken_profiles_are_refused_with_the_fix(change: Any, message: str) -> None:
    raw = copy.deepcopy(RAW)
    change(raw)
    with pytest.raises(ConfigError, match=message) as info:
        parse_profile(raw, name="broken")
    assert "gpu_calibrate.py" in str(info.value)


def test_load_profile_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "other-gpu.json"
    path.write_text(DATA.read_text())
    assert load_profile(path).name == "other-gpu"
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="bad"):
        load_profile(bad)
    with pytest.raises(ConfigError, match="bundled"):
        bundled_profile("no-such-gpu")


# --- wake times ---


def test_the_bundled_profile_states_each_wake_time_and_its_source() -> None:
    wake = H200.wake
    assert wake is not None
    assert wake.weights_bytes == 8_030_261_248 * 2
    assert (wake.asleep_1.seconds, wake.asleep_2.seconds, wake.stopped.seconds) == (0.29, 2.7, 42.7)
    for figure in (wake.asleep_1, wake.asleep_2, wake.stopped):
        assert figure.source.startswith("estimate, not measured")


def test_wake_times_a_file_leaves_out_are_estimated_from_the_profile() -> None:
    raw = copy.deepcopy(RAW)
    del raw["wake_s"]
    wake = parse_profile(raw).wake
    assert wake is not None
    weights = 8_030_261_248 * 2
    h2d = RAW["copy_gbps"]["gb1"]["h2d"] * 1e9
    assert wake.asleep_1.seconds == pytest.approx(weights / h2d)
    assert "54.9 GB/s host-to-device" in wake.asleep_1.source
    assert wake.asleep_2.seconds == pytest.approx(weights / RELOAD_BYTES_PER_S)
    assert wake.stopped.seconds == pytest.approx(ENGINE_START_S + weights / RELOAD_BYTES_PER_S)
    assert all(
        f.source.startswith("estimate") for f in (wake.asleep_1, wake.asleep_2, wake.stopped)
    )
    raw["model"] = {"kv_bytes_per_token": 1000}  # no parameter count: an 8B model assumed
    assert parse_profile(raw).wake.weights_bytes == DEFAULT_WEIGHTS_BYTES  # type: ignore[union-attr]
    raw["wake_s"] = {"stopped": {"seconds": 7.5, "source": "measured"}}
    stopped = parse_profile(raw).wake.stopped  # type: ignore[union-attr]
    assert (stopped.seconds, stopped.source) == (7.5, "measured")


@pytest.mark.parametrize(
    ("wake_s", "message"),
    [
        ({"asleep-3": {"seconds": 1.0}}, "wake_s names 'asleep-3'"),
        ({"stopped": {"seconds": -1.0}}, "seconds >= 0"),
        ({"stopped": 5.0}, "seconds >= 0"),
    ],
)
def test_broken_wake_times_are_refused(wake_s: dict[str, Any], message: str) -> None:
    raw = copy.deepcopy(RAW)
    raw["wake_s"] = wake_s
    with pytest.raises(ConfigError, match=message):
        parse_profile(raw)
