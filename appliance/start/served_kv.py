"""The KV bytes per token of the model the workers serve, for every byte the appliance
prices or shows (the reaper's holds, the host tier's room, the state's resident bytes, an
operator's release). Part of the composition root: the daemon asks once the workers are up.

vLLM and external workers: the served model's config.json (its directory, or for a hub
name the Hugging Face cache vLLM downloaded it to) at `engine.kv_cache_dtype`
(appliance/perf/kv_bytes.py). The simulated workers model the GPU profile's model, so
theirs is the profile's figure (the bundled profile: Llama-3-8B's shape in bf16, 131,072 B).
Where no config can be read (an external server's model that is not on this machine) the
figure is the profile's too, and `KvBytes.how` says why.
"""

from __future__ import annotations

from appliance.config.settings import EngineKind, EngineSettings
from appliance.domain.errors import ConfigError
from appliance.perf.kv_bytes import KvBytes, find_model_config, model_kv_bytes
from appliance.perf.profile import GpuProfile


def served_kv_bytes(engine: EngineSettings, kind: EngineKind, profile: GpuProfile) -> KvBytes:
    """The served model's KV bytes per token, and how the figure was reached."""
    profiles = f"GPU profile {profile.name}'s model"
    if kind == EngineKind.SIM:
        return KvBytes(profile.kv_bytes_per_token, f"the simulated model: {profiles}")
    config = find_model_config(engine.model)
    if config is None:
        why = f"no config.json of {engine.model or 'the served model'} on this machine"
        return KvBytes(profile.kv_bytes_per_token, f"{profiles} ({why})")
    try:
        return model_kv_bytes(config, engine.kv_cache_dtype)
    except ConfigError as exc:
        return KvBytes(profile.kv_bytes_per_token, f"{profiles} ({exc.message})")
