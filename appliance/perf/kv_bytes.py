"""KV bytes per token of a served model, from its Hugging Face `config.json`.

Model of the world: every token a session keeps in a worker costs, in each attention layer,
one key and one value vector per KV head: `layers x KV heads x head dim x 2 x dtype bytes`
(Llama-3-8B in bf16: 32 x 8 x 128 x 2 x 2 = 131,072 B; the tests' tiny Llama: 2 x 2 x 64 x
2 x 2 = 1,024 B). The dtype is the KV cache's (`engine.kv_cache_dtype`): `auto` stores KV at
the model's dtype as vLLM loads it (bf16 or fp16: 2 B; vLLM loads a float32 checkpoint in
16 bits), fp8 at 1 B, which halves the figure.

Two kinds of model are priced differently, and said so in `KvBytes.how`:
- Sliding-window layers count as full layers. vLLM lets blocks that slid out of a window
  go only under its hybrid KV cache manager, which it turns off on the CPU build (and with a
  KV connector that does not support it; the appliance's retention connector does): every
  layer is then allocated a full layer's blocks. Where the hybrid manager runs (CUDA) the
  figure is an upper bound for sessions longer than the window. Layers that keep a
  fixed-size state instead of per-token KV (`layer_types` entries such as
  `linear_attention` or `mamba`) are not counted.
- MLA models (DeepSeek-V2/V3, Kimi-K2: `kv_lora_rank` set) cache one compressed latent per
  token and layer, shared by keys and values: `layers x (kv_lora_rank + qk_rope_head_dim) x
  dtype bytes` (DeepSeek-V3 in bf16: 61 x 576 x 2 = 70,272 B).

Multimodal configs keep the language model's fields under `text_config`; those win.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.domain.errors import ConfigError

KV_CACHE_DTYPE_BYTES = {
    "bfloat16": 2,
    "float16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}
"""Bytes per element of each `engine.kv_cache_dtype` but `auto` (vLLM's --kv-cache-dtype)."""
KV_CACHE_DTYPES = ("auto", *KV_CACHE_DTYPE_BYTES)

_MODEL_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 2, "float": 2}
"""What `auto` stores per element for a checkpoint's dtype: float32 loads in 16 bits."""
_NO_KV_LAYERS = ("linear_attention", "mamba", "conv", "recurrent", "ssm")


@dataclass(frozen=True, slots=True)
class KvBytes:
    """A model's KV bytes per token and how the figure was reached (one line)."""

    bytes_per_token: int
    how: str


def kv_bytes_from_config(config: Mapping[str, Any], kv_cache_dtype: str = "auto") -> KvBytes:
    """The KV bytes per token of the model `config` (a decoded config.json) describes.
    Raises ValueError naming the field it lacks."""
    text = config.get("text_config")
    fields: dict[str, Any] = {**config, **(text if isinstance(text, Mapping) else {})}
    layers = _attention_layers(fields)
    size, dtype = _dtype_bytes(fields, kv_cache_dtype)
    rank = fields.get("kv_lora_rank")
    if isinstance(rank, int) and rank > 0:
        rope = _int(fields, "qk_rope_head_dim", default=0)
        per_token = layers * (rank + rope) * size
        how = f"MLA: {layers} layers x (kv_lora_rank {rank} + rope dim {rope}) x {size} B {dtype}"
        return KvBytes(per_token, how)
    heads = _int(fields, "num_attention_heads", "n_head", "num_heads")
    kv_heads = _int(fields, "num_key_value_heads", "num_kv_heads", "n_head_kv", default=heads)
    if fields.get("multi_query") is True:
        kv_heads = 1
    head_dim = fields.get("head_dim")
    if not isinstance(head_dim, int) or head_dim <= 0:
        head_dim = _int(fields, "hidden_size", "n_embd", "d_model") // heads
    per_token = layers * kv_heads * head_dim * 2 * size
    how = (
        f"{layers} layers x {kv_heads} KV heads x head dim {head_dim} x 2 (K, V) x {size} B {dtype}"
    )
    windowed = fields.get("sliding_window") and fields.get("use_sliding_window") is not False
    if windowed or "sliding_attention" in (fields.get("layer_types") or ()):
        how += "; sliding-window layers counted as full ones"
    return KvBytes(per_token, how)


def model_kv_bytes(config_path: Path, kv_cache_dtype: str = "auto") -> KvBytes:
    """`kv_bytes_from_config` of a config.json file; ConfigError when it cannot say."""
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{config_path}: cannot read the model's config ({exc})") from exc
    try:
        return kv_bytes_from_config(config, kv_cache_dtype)
    except ValueError as exc:
        raise ConfigError(f"{config_path}: cannot price the model's KV ({exc})") from exc


def find_model_config(model: str | None, environ: Mapping[str, str] | None = None) -> Path | None:
    """The config.json of `model`: in its directory, or for a hub name (`org/name`) in the
    Hugging Face cache (HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub), the newest
    snapshot's; None when neither has one."""
    if not model:
        return None
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path / "config.json"
    if model.startswith(("/", ".", "~")) or model.count("/") != 1:
        return None  # a path, not a hub name
    env = os.environ if environ is None else environ
    hub = env.get("HF_HUB_CACHE") or (
        str(Path(env["HF_HOME"]) / "hub") if env.get("HF_HOME") else None
    )
    cache = Path(hub) if hub else Path.home() / ".cache" / "huggingface" / "hub"
    snapshots = cache / f"models--{model.strip('/').replace('/', '--')}" / "snapshots"
    found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def _attention_layers(fields: Mapping[str, Any]) -> int:
    layers = _int(fields, "num_hidden_layers", "n_layer", "num_layers")
    kinds = fields.get("layer_types")
    if isinstance(kinds, list) and kinds:
        layers = sum(1 for k in kinds if not any(n in str(k) for n in _NO_KV_LAYERS))
        if layers == 0:
            raise ValueError("no layer_types entry keeps per-token KV")
    return layers


def _dtype_bytes(fields: Mapping[str, Any], kv_cache_dtype: str) -> tuple[int, str]:
    if kv_cache_dtype != "auto":
        if kv_cache_dtype not in KV_CACHE_DTYPE_BYTES:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}; known: {KV_CACHE_DTYPES}")
        return KV_CACHE_DTYPE_BYTES[kv_cache_dtype], kv_cache_dtype
    dtype = str(fields.get("dtype") or fields.get("torch_dtype") or "float32")
    dtype = dtype.removeprefix("torch.")
    if dtype not in _MODEL_DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: set engine.kv_cache_dtype (e.g. bfloat16)")
    if dtype in ("float32", "float"):
        return _MODEL_DTYPE_BYTES[dtype], "16-bit (a float32 checkpoint loads in 16 bits)"
    return _MODEL_DTYPE_BYTES[dtype], dtype


def _int(fields: Mapping[str, Any], *names: str, default: int | None = None) -> int:
    for name in names:
        value = fields.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    if default is not None:
        return default
    raise ValueError(f"config has no {' / '.join(names)}")
