"""A GPU profile: what one real GPU measured, as typed values (the calibration JSON format).

Model of the world: a profile is the output of `gpu_calibrate.py` for one GPU and one model
shape. It holds timing points (full prefills, prefills on a reused context, decode steps by
batch size and context, host<->GPU copies by size) and the model's KV bytes per token. The
points stay points here; `latency.py` fits them. Another GPU is another JSON file: the
numbers are data, never constants in code. The bundled default lives in `appliance/data/`.

Format notes (gpu_calibrate.py): `incremental_prefill_s` maps a reused context length to the
time for `delta` fresh tokens on top of it; the file does not record `delta`, which the
script fixes at 512 on a GPU and 128 with `--tiny` (on the CPU), so that is what is assumed
unless the file carries `incremental_prefill_fresh_tokens`. `batched_decode_step_s` and
`grid_decode_step_s` keys read `B{batch}_ctx{context per sequence}`, `grid_prefill_s` keys
`ctx{reused}_fresh{fresh}`. Copy entries give GB/s (1e9 bytes) for a copy of `bytes`;
`d2d_*` is device-to-device bandwidth counting bytes read plus bytes written. The device's
memory is the first NVML snapshot's `mem_total`, or `memory_bytes` (`appliance profile`
writes that one: appliance/perf/box_profile.py).

Wake times (`wake_s`, optional; `WakeTimes`): seconds from each resting state of a worker
(`appliance.policy.worker_power`) to serving, each with its source. gpu_calibrate.py does not
measure them yet; an entry the file leaves out is estimated from the profile (see
`wake_times`) and says so.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

from appliance.domain.errors import ConfigError

DEFAULT_PROFILE = "h200-llama3-8b-shape"
"""The bundled profile used when the configuration names none."""

_GRID_PREFILL_KEY = re.compile(r"^ctx(\d+)_fresh(\d+)$")
_DECODE_KEY = re.compile(r"^B(\d+)_ctx(\d+)$")
_CALIBRATE_DELTA = {"cuda": 512, "cpu": 128}  # gpu_calibrate.py's `delta` per device
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "int8": 1}
DEFAULT_WEIGHTS_BYTES = 16_060_522_496
"""Weights of a profile that names no parameter count: Llama-3-8B in bf16 (8.03e9 x 2 B)."""
RELOAD_BYTES_PER_S = 6e9
"""Estimate, not measured: weights read from the page cache and copied to the GPU when a
worker wakes from sleep level 2 (16 GB in 2.7 s), near the top of the 0.8-2.6 s level-2 wakes that
vLLM's sleep-mode post reports for its models (blog.vllm.ai/2025/10/26/sleep-mode.html)."""
ENGINE_START_S = 40.0
"""Estimate, not measured: a stopped vLLM worker's start before it loads weights (Python and
CUDA initialisation, torch.compile from its cache, CUDA graph capture, the first batch).
The same post puts a full reload at 30-100+ s; the design notes' verifier took 4.4-4.7
min to wake a whole container."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The measured model's shape; only `kv_bytes_per_token` drives the latency model."""

    kv_bytes_per_token: int
    params: int | None = None
    layers: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    dtype: str | None = None


@dataclass(frozen=True, slots=True)
class PrefillPoint:
    """`fresh_tokens` computed on top of `reused_tokens` already in the KV cache took
    `seconds` (batch 1)."""

    fresh_tokens: int
    reused_tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class DecodePoint:
    """One decode step of `batch_size` sequences, each with `context_tokens` of KV, took
    `seconds`."""

    batch_size: int
    context_tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class CopyPoint:
    """One copy of `nbytes` took `h2d_s` host to GPU and `d2h_s` GPU to host."""

    nbytes: int
    h2d_s: float
    d2h_s: float


@dataclass(frozen=True, slots=True)
class WakeFigure:
    """Seconds from one resting state to serving, and where the figure comes from."""

    seconds: float
    source: str


@dataclass(frozen=True, slots=True)
class WakeTimes:
    """A worker's wake times by resting state (sleep levels 1 and 2, stopped), and the
    bytes of its weights (what sleep level 1 keeps in host memory)."""

    asleep_1: WakeFigure
    asleep_2: WakeFigure
    stopped: WakeFigure
    weights_bytes: int


@dataclass(frozen=True, slots=True)
class GpuProfile:
    """What one GPU measured for one model shape."""

    name: str
    gpu: str
    model: ModelShape
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    copies: tuple[CopyPoint, ...]
    d2d_gbps: float | None = None
    memory_bytes: int | None = None
    wake: WakeTimes | None = None
    """Wake times by resting state (`parse_profile` always fills them in)."""

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    def for_kv_bytes(self, kv_bytes_per_token: int) -> GpuProfile:
        """The same timings with the KV of a model of `kv_bytes_per_token` (the served
        model's, `appliance/perf/kv_bytes.py`): what every byte figure is priced at."""
        if kv_bytes_per_token == self.kv_bytes_per_token:
            return self
        model = replace(self.model, kv_bytes_per_token=kv_bytes_per_token)
        return replace(self, model=model)


def load_profile(path: str | Path) -> GpuProfile:
    """Read a calibration JSON file."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"GPU profile {p}: cannot read it as JSON ({exc})") from exc
    return parse_profile(data, name=p.stem)


def bundled_profile(name: str = DEFAULT_PROFILE) -> GpuProfile:
    """A profile shipped in `appliance/data/` (see `bundled_profile_names`)."""
    resource = resources.files("appliance").joinpath("data").joinpath(f"{name}.json")
    if not resource.is_file():
        known = ", ".join(bundled_profile_names()) or "none"
        raise ConfigError(f"no bundled GPU profile {name!r}; bundled: {known}")
    return parse_profile(json.loads(resource.read_text()), name=name)


def bundled_profile_names() -> list[str]:
    data = resources.files("appliance").joinpath("data")
    return sorted(
        entry.name.removesuffix(".json") for entry in data.iterdir() if entry.name.endswith(".json")
    )


def parse_profile(data: Mapping[str, Any], *, name: str = "profile") -> GpuProfile:
    """Build a profile from the decoded calibration JSON."""

    def fail(what: str) -> ConfigError:
        return ConfigError(
            f"GPU profile {name}: {what}; re-run gpu_calibrate.py to produce a complete file"
        )

    shape = _model_shape(data, fail)
    device = str(data.get("device", "cuda"))
    prefill = _prefill_points(data, device, fail)
    decode = _decode_points(data, fail)
    copies, d2d_gbps = _copy_points(data, fail)
    wake = wake_times(data.get("wake_s") or {}, shape, copies, fail)
    return GpuProfile(
        name=name,
        gpu=str(data.get("gpu", device)),
        model=shape,
        prefill=tuple(sorted(prefill, key=lambda p: (p.reused_tokens, p.fresh_tokens))),
        decode=tuple(sorted(decode, key=lambda p: (p.batch_size, p.context_tokens))),
        copies=tuple(sorted(copies, key=lambda c: c.nbytes)),
        d2d_gbps=d2d_gbps,
        memory_bytes=_memory_bytes(data),
        wake=wake,
    )


_Fail = Callable[[str], ConfigError]
_WAKE_STATES = ("asleep-1", "asleep-2", "stopped")


def wake_times(
    given: Mapping[str, Any], shape: ModelShape, copies: Sequence[CopyPoint], fail: _Fail
) -> WakeTimes:
    """Each state's wake time: the file's `wake_s[STATE]` (`{"seconds", "source"}`) where it
    has one, else an estimate from the profile: level 1 copies the weights back at the
    largest measured host-to-device copy's speed; level 2 reloads them
    (`RELOAD_BYTES_PER_S`); stopped starts an engine (`ENGINE_START_S`) and reloads them."""
    dtype = (shape.dtype or "bfloat16").removeprefix("torch.")
    if shape.params is not None:
        weights = shape.params * _DTYPE_BYTES.get(dtype, 2)
        what = f"{weights / 1e9:.1f} GB of weights ({shape.params:.3g} params x {dtype})"
    else:
        weights, what = DEFAULT_WEIGHTS_BYTES, "16.1 GB of weights (assumed: 8B in bf16)"
    big = max(copies, key=lambda c: c.nbytes)
    h2d = big.nbytes / big.h2d_s
    reload_s = weights / RELOAD_BYTES_PER_S
    estimates = {
        "asleep-1": WakeFigure(
            weights / h2d,
            f"estimate: {what} / {h2d / 1e9:.1f} GB/s host-to-device (the profile's "
            f"{big.nbytes / 2**20:.0f} MiB copy)",
        ),
        "asleep-2": WakeFigure(
            reload_s, f"estimate: {what} / {RELOAD_BYTES_PER_S / 1e9:g} GB/s reload (judgement)"
        ),
        "stopped": WakeFigure(
            ENGINE_START_S + reload_s,
            f"estimate: {ENGINE_START_S:g} s engine start (judgement) + the level-2 reload",
        ),
    }
    for state, entry in given.items():
        if state not in estimates:
            raise fail(f"wake_s names {state!r}; known: {', '.join(_WAKE_STATES)}")
        if not isinstance(entry, Mapping) or not _non_negative(entry.get("seconds")):
            raise fail(f"wake_s[{state!r}] needs seconds >= 0 and a source")
        estimates[state] = WakeFigure(float(entry["seconds"]), str(entry.get("source", "")))
    return WakeTimes(estimates["asleep-1"], estimates["asleep-2"], estimates["stopped"], weights)


def _model_shape(data: Mapping[str, Any], fail: _Fail) -> ModelShape:
    model = data.get("model")
    if not isinstance(model, Mapping) or not _positive_int(model.get("kv_bytes_per_token")):
        raise fail("model.kv_bytes_per_token is missing")
    return ModelShape(
        kv_bytes_per_token=int(model["kv_bytes_per_token"]),
        params=_opt_int(model.get("params")),
        layers=_opt_int(model.get("layers")),
        kv_heads=_opt_int(model.get("kv_heads")),
        head_dim=_opt_int(model.get("head_dim")),
        dtype=str(model["dtype"]) if "dtype" in model else None,
    )


def _prefill_points(data: Mapping[str, Any], device: str, fail: _Fail) -> list[PrefillPoint]:
    delta = data.get("incremental_prefill_fresh_tokens", _CALIBRATE_DELTA.get(device, 512))
    prefill = [PrefillPoint(n, 0, s) for n, s in _int_keyed(data, "full_prefill_s", fail)]
    prefill += [
        PrefillPoint(int(delta), c, s) for c, s in _int_keyed(data, "incremental_prefill_s", fail)
    ]
    for key, s in _seconds(data, "grid_prefill_s", fail):
        m = _GRID_PREFILL_KEY.match(key)
        if m is None:
            raise fail(f"grid_prefill_s key {key!r} is not ctx<N>_fresh<N>")
        prefill.append(PrefillPoint(int(m[2]), int(m[1]), s))
    if not any(p.reused_tokens == 0 for p in prefill):
        raise fail("full_prefill_s has no points")
    return prefill


def _decode_points(data: Mapping[str, Any], fail: _Fail) -> list[DecodePoint]:
    decode = [DecodePoint(1, c, s) for c, s in _int_keyed(data, "decode_step_s", fail)]
    for field in ("batched_decode_step_s", "grid_decode_step_s"):
        for key, s in _seconds(data, field, fail):
            m = _DECODE_KEY.match(key)
            if m is None:
                raise fail(f"{field} key {key!r} is not B<N>_ctx<N>")
            decode.append(DecodePoint(int(m[1]), int(m[2]), s))
    if not decode:
        raise fail("decode_step_s has no points")
    return decode


def _copy_points(data: Mapping[str, Any], fail: _Fail) -> tuple[list[CopyPoint], float | None]:
    """The host<->GPU copies, and the device-to-device bandwidth if measured."""
    copies: list[CopyPoint] = []
    d2d_gbps: float | None = None
    for key, entry in dict(data.get("copy_gbps") or {}).items():
        if key.startswith("d2d") and _positive_number(entry):
            d2d_gbps = float(entry)
        elif isinstance(entry, Mapping) and all(
            _positive_number(entry.get(k)) for k in ("bytes", "h2d", "d2h")
        ):
            nbytes = int(entry["bytes"])
            copies.append(
                CopyPoint(nbytes, nbytes / (entry["h2d"] * 1e9), nbytes / (entry["d2h"] * 1e9))
            )
    if not copies:
        raise fail("copy_gbps has no host<->GPU copy points")
    return copies, d2d_gbps


def _seconds(data: Mapping[str, Any], field: str, fail: _Fail) -> list[tuple[str, float]]:
    table = data.get(field) or {}
    if not isinstance(table, Mapping):
        raise fail(f"{field} is not a table")
    out: list[tuple[str, float]] = []
    for key, value in table.items():
        if not _positive_number(value):
            raise fail(f"{field}[{key!r}] is not a positive number of seconds")
        out.append((str(key), float(value)))
    return out


def _int_keyed(data: Mapping[str, Any], field: str, fail: _Fail) -> list[tuple[int, float]]:
    out: list[tuple[int, float]] = []
    for key, value in _seconds(data, field, fail):
        if not key.isdigit():
            raise fail(f"{field} key {key!r} is not a token count")
        out.append((int(key), value))
    return out


def _memory_bytes(data: Mapping[str, Any]) -> int | None:
    if _positive_int(data.get("memory_bytes")):  # `appliance profile` writes it
        return int(data["memory_bytes"])
    for snapshot in ("nvml_idle", "nvml_loaded", "nvml_end"):
        devices = (data.get(snapshot) or {}).get("devices") or []
        if (
            devices
            and isinstance(devices[0], Mapping)
            and _positive_int(devices[0].get("mem_total"))
        ):
            return int(devices[0]["mem_total"])
    return None


def _positive_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _non_negative(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _opt_int(value: object) -> int | None:
    return value if isinstance(value, int) and _positive_int(value) else None
