"""KV bytes per token from a model's config.json, and which figure the appliance prices with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from appliance.config.settings import EngineKind, EngineSettings
from appliance.domain.errors import ConfigError
from appliance.perf.kv_bytes import find_model_config, kv_bytes_from_config, model_kv_bytes
from appliance.perf.profile import bundled_profile
from appliance.start.served_kv import served_kv_bytes

TINY = {  # what tests/fixtures/tiny_model.py writes
    "architectures": ["LlamaForCausalLM"],
    "dtype": "bfloat16",
    "head_dim": 64,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
}
LLAMA3_8B = {
    "torch_dtype": "bfloat16",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
}
DEEPSEEK_V3 = {
    "torch_dtype": "bfloat16",
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
}
GEMMA3_27B = {  # a multimodal config: the language model's fields under text_config
    "torch_dtype": "bfloat16",
    "text_config": {
        "head_dim": 128,
        "hidden_size": 5376,
        "num_attention_heads": 32,
        "num_hidden_layers": 62,
        "num_key_value_heads": 16,
        "sliding_window": 1024,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    },
}


@pytest.mark.parametrize(
    ("config", "dtype", "expected"),
    [
        (TINY, "auto", 1024),  # 2 x 2 x 64 x 2 x 2
        (TINY, "fp8", 512),
        (LLAMA3_8B, "auto", 131_072),  # the bundled profile's model shape
        (LLAMA3_8B, "fp8_e4m3", 65_536),
        ({**LLAMA3_8B, "torch_dtype": "float32"}, "auto", 131_072),  # loads in 16 bits
        ({**LLAMA3_8B, "num_key_value_heads": None}, "auto", 4 * 131_072),  # MHA: all heads
        ({**LLAMA3_8B, "multi_query": True}, "auto", 131_072 // 8),
        (DEEPSEEK_V3, "auto", 61 * (512 + 64) * 2),  # MLA: one latent per token and layer
        (DEEPSEEK_V3, "fp8", 61 * (512 + 64)),
        (GEMMA3_27B, "auto", 6 * 16 * 128 * 2 * 2),  # every attention layer in layer_types
    ],
)
def test_bytes_per_token_from_the_config(config: dict[str, Any], dtype: str, expected: int) -> None:
    assert kv_bytes_from_config(config, dtype).bytes_per_token == expected


def test_how_states_the_treatment_of_windows_and_latents() -> None:
    sliding = kv_bytes_from_config(GEMMA3_27B).how
    assert "sliding-window layers counted as full ones" in sliding
    assert kv_bytes_from_config(DEEPSEEK_V3).how.startswith("MLA: 61 layers")
    assert "sliding" not in kv_bytes_from_config(TINY).how


def test_layers_with_a_fixed_state_hold_no_per_token_kv() -> None:
    hybrid = {**LLAMA3_8B, "layer_types": ["linear_attention"] * 3 + ["full_attention"] * 8}
    assert kv_bytes_from_config(hybrid).bytes_per_token == 8 * 8 * 128 * 2 * 2
    with pytest.raises(ValueError, match="no layer_types entry"):
        kv_bytes_from_config({**LLAMA3_8B, "layer_types": ["mamba"] * 4})


@pytest.mark.parametrize(
    ("config", "dtype", "message"),
    [
        ({"hidden_size": 64, "num_attention_heads": 2}, "auto", "num_hidden_layers"),
        ({**LLAMA3_8B, "torch_dtype": "int8"}, "auto", "set engine.kv_cache_dtype"),
        (LLAMA3_8B, "nvfp4", "kv_cache_dtype 'nvfp4'"),
    ],
)
def test_what_cannot_be_priced_says_why(config: dict[str, Any], dtype: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kv_bytes_from_config(config, dtype)


def test_config_files_are_found_in_the_model_dir_and_the_hub_cache(tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    assert find_model_config(str(model), {}) == model / "config.json"
    assert model_kv_bytes(model / "config.json").bytes_per_token == 1024
    snapshot = tmp_path / "hub" / "models--org--name" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(LLAMA3_8B))
    env = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    assert find_model_config("org/name", env) == snapshot / "config.json"
    assert find_model_config("org/other", env) is None
    assert find_model_config(str(tmp_path / "org/name"), env) is None  # a path: no hub lookup
    (model / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read the model's config"):
        model_kv_bytes(model / "config.json")


def test_the_served_figure_by_engine(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    profile = bundled_profile()
    vllm = EngineSettings(kind=EngineKind.VLLM, model=str(tmp_path))
    assert served_kv_bytes(vllm, EngineKind.VLLM, profile).bytes_per_token == 1024
    fp8 = EngineSettings(kind=EngineKind.VLLM, model=str(tmp_path), kv_cache_dtype="fp8")
    assert served_kv_bytes(fp8, EngineKind.VLLM, profile).bytes_per_token == 512
    # The simulated workers model the profile's model, whatever model names their tokenizer.
    sim = served_kv_bytes(vllm, EngineKind.SIM, profile)
    assert sim.bytes_per_token == profile.kv_bytes_per_token == 131_072
    assert "simulated" in sim.how
    urls = ["http://127.0.0.1:1"]
    gone = EngineSettings(
        kind=EngineKind.EXTERNAL, model=str(tmp_path / "absent"), external_urls=urls
    )
    away = served_kv_bytes(gone, EngineKind.EXTERNAL, profile)
    assert away.bytes_per_token == 131_072 and "no config.json" in away.how


def test_a_profile_priced_at_another_models_bytes_keeps_its_timings() -> None:
    profile = bundled_profile()
    served = profile.for_kv_bytes(1024)
    assert served.kv_bytes_per_token == 1024
    assert (served.prefill, served.decode, served.copies) == (
        profile.prefill,
        profile.decode,
        profile.copies,
    )
    assert profile.for_kv_bytes(profile.kv_bytes_per_token) is profile
