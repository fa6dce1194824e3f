"""A profile of this box: what `appliance profile` measured, as a GPU profile document.

Model of the world: the measuring run (appliance/engines/profiling/box_measure.py, inside the
interpreter that has vLLM) times full prefills at a few lengths, prefills of fresh tokens
on a cached context, decode steps at a few batch sizes and contexts, and copies of a few
sizes between host memory and the worker's device, all through vLLM on the worker's own
device: CUDA, or the CPU build, whose KV lives in host memory, so its "copy" is a copy
between two host buffers (the document's `copy_kind` says which). This module adds the
served model's shape (its KV bytes per token from its config, its parameter count) and
checks the result reads as a profile (`parse_profile`), in the format of the bundled one
(appliance/data/h200-llama3-8b-shape.json), so that `engine.gpu_profile` and
`appliance replay --gpu-profile` take it as they take that one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from appliance.perf.kv_bytes import KvBytes
from appliance.perf.profile import GpuProfile, parse_profile

MEASURED_KEYS = (
    "device",
    "gpu",
    "torch",
    "vllm",
    "copy_kind",
    "memory_bytes",
    "kv_cache_dtype",
    "full_prefill_s",
    "incremental_prefill_s",
    "incremental_prefill_fresh_tokens",
    "decode_step_s",
    "batched_decode_step_s",
    "copy_gbps",
)
"""What a measuring run reports and the document keeps, in this order."""


def profile_document(
    measured: Mapping[str, Any], kv: KvBytes, *, params: int | None, name: str
) -> tuple[dict[str, Any], GpuProfile]:
    """The profile document of a measuring run of a model whose KV is `kv` and whose
    weights have `params` parameters, and the profile it reads as (ConfigError when the
    run's points do not make one)."""
    doc: dict[str, Any] = {"measured_by": "appliance profile"}
    doc.update({k: measured[k] for k in MEASURED_KEYS if k in measured})
    model: dict[str, Any] = {"kv_bytes_per_token": kv.bytes_per_token, "kv_bytes": kv.how}
    if params is not None:
        model["params"] = params
    if measured.get("model_dtype"):
        model["dtype"] = str(measured["model_dtype"])
    doc["model"] = model
    return doc, parse_profile(doc, name=name)
