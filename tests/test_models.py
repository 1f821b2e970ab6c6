"""Tests for kvlens.models: published KV-cache geometry, TP split, windows, HF config parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlens.errors import ConfigError, InputError
from kvlens.models import (
    DEFAULT_MODEL,
    MODELS,
    KvGroup,
    ModelGeometry,
    dtype_bytes,
    from_hf_config,
    get_model,
    resolve_model,
)

# Bytes per token in bf16, each from the model's published config.json.
PUBLISHED_BF16 = {
    "llama-3.1-8b": 131_072,
    "llama-3.1-70b": 327_680,
    "qwen2.5-7b": 57_344,
    "qwen2.5-32b": 262_144,
    "qwen2.5-72b": 327_680,
    "mistral-7b-v0.1": 131_072,
    "codellama-13b": 819_200,
    "gemma-2-27b": 376_832,
    "deepseek-v3": 70_272,
}


@pytest.mark.parametrize(("name", "expected"), sorted(PUBLISHED_BF16.items()))
def test_published_bytes_per_token(name: str, expected: int) -> None:
    assert get_model(name).kv_bytes_per_token() == expected


def test_hand_computed_formulas() -> None:
    assert get_model("llama-3.1-8b").kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2
    assert get_model("gemma-2-27b").kv_bytes_per_token() == 2 * 46 * 16 * 128 * 2
    # MLA: one latent per layer, no K/V factor of 2.
    assert get_model("deepseek-v3").kv_bytes_per_token() == 61 * (512 + 64) * 2


def test_every_registry_model_is_pinned() -> None:
    assert set(MODELS) == set(PUBLISHED_BF16)
    assert DEFAULT_MODEL in MODELS
    assert get_model(DEFAULT_MODEL).kv_bytes_per_token() == 320 * 1024


def test_deepseek_stores_activated_params() -> None:
    assert get_model("deepseek-v3").num_params == 37e9


@pytest.mark.parametrize("name", sorted(PUBLISHED_BF16))
def test_fp8_halves_and_fp32_doubles(name: str) -> None:
    model = get_model(name)
    bf16 = model.kv_bytes_per_token()
    assert model.kv_bytes_per_token(dtype="fp8") * 2 == bf16
    assert model.kv_bytes_per_token(dtype="fp8_e4m3") * 2 == bf16
    assert model.kv_bytes_per_token(dtype="float32") == bf16 * 2
    assert model.with_dtype("fp8").kv_bytes_per_token() * 2 == bf16


def test_dtype_names() -> None:
    for name in ("bf16", "bfloat16", "fp16", "float16", "BF16"):
        assert dtype_bytes(name) == 2
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2", "float8"):
        assert dtype_bytes(name) == 1
    assert dtype_bytes("fp32") == dtype_bytes("float32") == 4


def test_unknown_dtype_names_value_and_accepted() -> None:
    with pytest.raises(ConfigError) as err:
        dtype_bytes("int3")
    assert "int3" in str(err.value)
    assert "bf16" in str(err.value) and "fp8" in str(err.value)
    with pytest.raises(ConfigError):
        get_model("llama-3.1-8b").with_dtype("int3")
    with pytest.raises(ConfigError):
        get_model("llama-3.1-8b").kv_bytes_per_token(dtype="int3")


def test_with_dtype_returns_copy() -> None:
    model = get_model("llama-3.1-8b")
    fp8 = model.with_dtype("fp8")
    assert fp8 is not model
    assert fp8.kv_dtype == "fp8" and model.kv_dtype == "bf16"
    assert fp8.groups == model.groups


def test_tensor_parallel_splits_kv_heads() -> None:
    assert get_model("llama-3.1-70b").kv_bytes_per_token(tp_size=8) == 40_960
    # 8 KV heads over 16 ranks: each rank keeps one replicated head, never zero or half,
    # so 2·32·1·128·2 = 16,384, not 131,072 / 16.
    assert get_model("llama-3.1-8b").kv_bytes_per_token(tp_size=16) == 16_384
    assert get_model("llama-3.1-8b").kv_bytes_per_token(tp_size=8) == 16_384
    # 4 KV heads over 8 ranks, likewise one per rank.
    assert get_model("qwen2.5-7b").kv_bytes_per_token(tp_size=8) == 2 * 28 * 1 * 128 * 2
    # 40 heads over 16 ranks: ceil(40/16) = 3 per rank.
    assert get_model("codellama-13b").kv_bytes_per_token(tp_size=16) == 2 * 40 * 3 * 128 * 2


def test_mla_latent_is_replicated_across_ranks() -> None:
    model = get_model("deepseek-v3")
    for tp in (1, 2, 8, 16):
        assert model.kv_bytes_per_token(tp_size=tp) == 70_272


@pytest.mark.parametrize("tp", [0, -1, 1.5, True])
def test_bad_tp_size(tp: object) -> None:
    with pytest.raises(ConfigError):
        get_model("llama-3.1-8b").kv_bytes_per_token(tp_size=tp)  # type: ignore[arg-type]


def test_gemma_kv_bytes_caps_sliding_layers() -> None:
    model = get_model("gemma-2-27b")
    per_layer_token = 2 * 16 * 128 * 2
    sliding = 23 * 4096 * per_layer_token
    full = 23 * 8192 * per_layer_token
    assert model.kv_bytes(8192) == sliding + full
    # Below the window every layer grows at the per-token rate.
    assert model.kv_bytes(1000) == 1000 * 376_832


def test_mistral_kv_bytes_capped_beyond_window() -> None:
    model = get_model("mistral-7b-v0.1")
    assert model.kv_bytes(4096) == 4096 * 131_072
    assert model.kv_bytes(100_000) == 4096 * 131_072
    assert model.kv_bytes(100) == 100 * 131_072


def test_kv_bytes_full_attention_is_linear() -> None:
    model = get_model("llama-3.1-70b")
    assert model.kv_bytes(0) == 0
    assert model.kv_bytes(100_000) == 100_000 * 327_680
    assert model.kv_bytes(1000, dtype="fp8", tp_size=8) == 1000 * 20_480


@pytest.mark.parametrize("tokens", [-1, 1.5, True])
def test_kv_bytes_rejects_bad_token_counts(tokens: object) -> None:
    with pytest.raises(InputError):
        get_model("llama-3.1-8b").kv_bytes(tokens)  # type: ignore[arg-type]


def test_block_bytes() -> None:
    model = get_model("llama-3.1-8b")
    assert model.block_size_tokens == 16
    assert model.block_bytes() == 16 * 131_072
    assert model.block_bytes(32, dtype="fp8", tp_size=8) == 32 * 16_384 // 2
    # A block is stored whole: a sliding window never caps it.
    gemma = get_model("gemma-2-27b")
    assert gemma.block_bytes(8192) == 8192 * 376_832
    with pytest.raises(ConfigError):
        model.block_bytes(0)


def test_lookup_by_hf_id_and_short_name_any_case() -> None:
    llama = get_model("llama-3.1-8b")
    assert get_model("meta-llama/Llama-3.1-8B-Instruct") is llama
    assert get_model("META-LLAMA/llama-3.1-8b-instruct") is llama
    assert get_model("Llama-3.1-8B") is llama
    assert get_model("  LLAMA-3.1-8B ") is llama
    assert get_model("Qwen/Qwen2.5-72B-Instruct") is get_model("qwen2.5-72b")
    assert get_model("deepseek-ai/DeepSeek-V3") is get_model("DeepSeek-V3")
    assert get_model("google/gemma-2-27b-it") is get_model("gemma-2-27b")
    assert get_model("mistralai/Mistral-7B-v0.1") is get_model("mistral-7b-v0.1")
    assert get_model("codellama/CodeLlama-13b-hf") is get_model("codellama-13b")


def test_unknown_model_lists_known_and_suggests_config() -> None:
    with pytest.raises(ConfigError) as err:
        get_model("gpt-9")
    message = str(err.value)
    assert "gpt-9" in message
    assert "llama-3.1-70b" in message
    assert "--model-config" in message


def test_resolve_model_defaults_and_precedence(tmp_path: Path) -> None:
    assert resolve_model() is get_model("llama-3.1-70b")
    assert resolve_model("qwen2.5-7b") is get_model("qwen2.5-7b")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN2_7B))
    # The config file wins over a name.
    from_file = resolve_model("llama-3.1-70b", config_path=path)
    assert from_file.kv_bytes_per_token() == 57_344


def test_geometry_validation() -> None:
    with pytest.raises(ConfigError):
        KvGroup("dense", 1, 1, 128)
    with pytest.raises(ConfigError):
        KvGroup("sliding", 1, 1, 128)
    with pytest.raises(ConfigError):
        KvGroup("full", 1, 1, 128, sliding_window_tokens=4096)
    with pytest.raises(ConfigError):
        KvGroup("mla", 1, 8, 128, kv_lora_rank=512, qk_rope_head_dim=64)
    with pytest.raises(ConfigError):
        KvGroup.full(0, 8, 128)
    with pytest.raises(ConfigError):
        ModelGeometry("empty", (), 32, 4096, 1e9)


def test_geometry_is_frozen_and_hashable() -> None:
    model = get_model("gemma-2-27b")
    with pytest.raises(AttributeError):
        model.kv_dtype = "fp8"  # type: ignore[misc]
    assert hash(model) == hash(get_model("gemma-2-27b"))


# Configs abridged from the published Hugging Face config.json files.
LLAMA_3_1_8B = {
    "_name_or_path": "meta-llama/Llama-3.1-8B-Instruct",
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}

QWEN2_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "sliding_window": 131072,
    "use_sliding_window": False,
    "max_window_layers": 28,
    "torch_dtype": "bfloat16",
}

DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "torch_dtype": "bfloat16",
}

GEMMA_2_27B = {
    "model_type": "gemma2",
    "hidden_size": 4608,
    "head_dim": 128,
    "num_attention_heads": 32,
    "num_hidden_layers": 46,
    "num_key_value_heads": 16,
    "sliding_window": 4096,
    "torch_dtype": "float32",
}

MISTRAL_7B = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "sliding_window": 4096,
    "torch_dtype": "bfloat16",
}


def test_from_hf_config_llama() -> None:
    model = from_hf_config(LLAMA_3_1_8B)
    assert model.name == "meta-llama/Llama-3.1-8B-Instruct"
    assert model.groups == (KvGroup.full(32, 8, 128),)
    assert model.kv_bytes_per_token() == 131_072
    assert model.kv_dtype == "bf16"
    assert (model.num_attention_heads, model.hidden_size) == (32, 4096)
    # No count given: the rough 12·L·h² estimate.
    assert model.num_params == 12 * 32 * 4096**2


def test_from_hf_config_defaults_kv_heads_to_attention_heads() -> None:
    config = {"hidden_size": 5120, "num_attention_heads": 40, "num_hidden_layers": 40}
    model = from_hf_config(config, name="codellama", num_params=13.0e9)
    assert model.name == "codellama"
    assert model.num_params == 13.0e9
    assert model.kv_bytes_per_token() == 819_200


def test_from_hf_config_qwen2_window_off() -> None:
    model = from_hf_config(QWEN2_7B)
    assert model.groups == (KvGroup.full(28, 4, 128),)
    assert model.kv_bytes_per_token() == 57_344
    assert model.kv_bytes(200_000) == 200_000 * 57_344


def test_from_hf_config_qwen2_window_on_from_max_window_layers() -> None:
    config = {**QWEN2_7B, "use_sliding_window": True, "sliding_window": 4096,
              "max_window_layers": 20}
    model = from_hf_config(config)
    assert model.groups == (KvGroup.full(20, 4, 128), KvGroup.sliding(8, 4, 128, 4096))


def test_from_hf_config_deepseek_v3_mla() -> None:
    model = from_hf_config(DEEPSEEK_V3, name="deepseek-v3")
    assert model.groups == (KvGroup.mla(61, 512, 64),)
    assert model.kv_bytes_per_token() == 70_272
    assert model.kv_bytes_per_token(tp_size=8) == 70_272


def test_from_hf_config_gemma2_alternates() -> None:
    model = from_hf_config(GEMMA_2_27B)
    assert model.groups == (KvGroup.sliding(23, 16, 128, 4096), KvGroup.full(23, 16, 128))
    assert model.kv_bytes_per_token(dtype="bf16") == 376_832
    assert model.kv_dtype == "fp32"
    assert model.kv_bytes(8192, dtype="bf16") == get_model("gemma-2-27b").kv_bytes(8192)


def test_from_hf_config_mistral_slides_everywhere() -> None:
    model = from_hf_config(MISTRAL_7B)
    assert model.groups == (KvGroup.sliding(32, 8, 128, 4096),)
    assert model.kv_bytes(10_000) == get_model("mistral-7b-v0.1").kv_bytes(10_000)


def test_from_hf_config_layer_types_take_precedence() -> None:
    # Says gemma2 (which would alternate) but layer_types decides: 5 sliding + 1 full.
    layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    config = {**GEMMA_2_27B, "num_hidden_layers": 6, "layer_types": layer_types,
              "sliding_window": 1024}
    model = from_hf_config(config)
    assert model.groups == (KvGroup.sliding(5, 16, 128, 1024), KvGroup.full(1, 16, 128))
    per_layer_token = 2 * 16 * 128 * 4
    assert model.kv_bytes(2048) == (5 * 1024 + 1 * 2048) * per_layer_token


def test_from_hf_config_gemma3_pattern() -> None:
    config = {**GEMMA_2_27B, "model_type": "gemma3_text", "num_hidden_layers": 12,
              "sliding_window_pattern": 6}
    model = from_hf_config(config)
    assert model.groups == (KvGroup.sliding(10, 16, 128, 4096), KvGroup.full(2, 16, 128))


def test_from_hf_config_text_config_nested() -> None:
    config = {"model_type": "llava", "text_config": dict(LLAMA_3_1_8B)}
    assert from_hf_config(config).kv_bytes_per_token() == 131_072


@pytest.mark.parametrize("config", [LLAMA_3_1_8B, QWEN2_7B, DEEPSEEK_V3, GEMMA_2_27B, MISTRAL_7B])
def test_from_hf_config_file_matches_dict(tmp_path: Path, config: dict) -> None:
    folder = tmp_path / "My-Model"
    folder.mkdir()
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    from_dict = from_hf_config(config, name="m")
    for source in (path, str(path)):
        from_file = from_hf_config(source, name="m")
        assert from_file == from_dict


def test_from_hf_config_file_name_defaults_to_folder(tmp_path: Path) -> None:
    folder = tmp_path / "Qwen2.5-7B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN2_7B))
    assert from_hf_config(folder / "config.json").name == "Qwen2.5-7B"


@pytest.mark.parametrize("key", ["num_hidden_layers", "num_attention_heads", "hidden_size"])
def test_missing_key_names_key_and_file(tmp_path: Path, key: str) -> None:
    config = {k: v for k, v in LLAMA_3_1_8B.items() if k != key}
    with pytest.raises(InputError) as err:
        from_hf_config(config)
    assert key in str(err.value)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(InputError) as err:
        from_hf_config(path)
    assert key in str(err.value) and str(path) in str(err.value)


def test_missing_mla_rope_dim_and_window() -> None:
    mla = {k: v for k, v in DEEPSEEK_V3.items() if k != "qk_rope_head_dim"}
    with pytest.raises(InputError, match="qk_rope_head_dim"):
        from_hf_config(mla)
    gemma = {**GEMMA_2_27B, "layer_types": ["sliding_attention"] * 46, "sliding_window": None}
    with pytest.raises(InputError, match="sliding_window"):
        from_hf_config(gemma)


def test_bad_values_and_layer_types() -> None:
    with pytest.raises(InputError, match="num_key_value_heads"):
        from_hf_config({**LLAMA_3_1_8B, "num_key_value_heads": "8"})
    with pytest.raises(InputError, match="layer_types"):
        from_hf_config({**LLAMA_3_1_8B, "layer_types": ["full_attention"] * 3})
    with pytest.raises(InputError, match="linear_attention"):
        from_hf_config({**LLAMA_3_1_8B, "layer_types": ["linear_attention"] * 32})


def test_bad_config_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        from_hf_config(tmp_path / "absent.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"hidden_size": 4096,\n')
    with pytest.raises(InputError) as err:
        from_hf_config(broken)
    assert str(broken) in str(err.value)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(InputError, match="JSON object"):
        from_hf_config(listed)
