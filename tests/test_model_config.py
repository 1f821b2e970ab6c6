"""--model-config config.json on every command that takes --model, with real-shaped config files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import duckdb
import pytest
from click.testing import CliRunner

from kvlens.cli import cli

# The published Hugging Face config.json files, field for field (the hub files carry no
# _name_or_path: the model's name is its folder's).
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "first_k_dense_replace": 3,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "torch_dtype": "bfloat16", "vocab_size": 129280,
}
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000,
}
# A model kvlens does not list: GQA with 4 KV heads of 64 over 12 layers, fp16 -> 2·12·4·64·2 B.
SMALL_GQA = {"model_type": "llama", "hidden_size": 768, "num_attention_heads": 12, "num_hidden_layers": 12,
             "num_key_value_heads": 4, "head_dim": 64, "torch_dtype": "float16"}


def _config(tmp_path: Path, folder: str, fields: dict[str, Any]) -> Path:
    path = tmp_path / folder / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fields, indent=2))
    return path


def _commands(group: click.Group, prefix: str = "") -> list[tuple[str, click.Command]]:
    out = []
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            out += _commands(cmd, f"{prefix}{name} ")
        else:
            out.append((prefix + name, cmd))
    return out


def test_every_command_with_model_takes_model_config() -> None:
    with_model = [n for n, c in _commands(cli) if any("--model" in p.opts for p in c.params)]
    assert set(with_model) >= {"import", "analyze", "simulate", "probe", "collect vllm", "collect otlp"}
    lacking = [n for n, c in _commands(cli) if n in with_model
               and not any("--model-config" in p.opts for p in c.params)]
    assert lacking == []


@pytest.fixture
def lake(tmp_path: Path, mooncake3: Path) -> Path:
    from kvlens.collector.importer import import_files

    lake = tmp_path / "lake"
    import_files("mooncake", [mooncake3], lake, scenario="s")  # no model on the rows
    return lake


def _analyze(lake: Path, db: Path, *extra: str) -> Any:
    result = CliRunner().invoke(cli, ["analyze", "--lake", str(lake), "--db", str(db), *extra])
    assert result.exit_code == 0, result.output
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute("SELECT model, kv_bytes_per_token, model_source, "
                           "(SELECT sum(bytes) / sum(tokens) FROM block_outcomes) FROM scenarios").fetchall()
    finally:
        con.close()


@pytest.mark.parametrize(("folder", "fields", "per_token"), [
    ("Llama-3.1-8B", LLAMA_3_1_8B, 131_072),  # dense GQA: 2·32·8·128·2
    ("DeepSeek-V3", DEEPSEEK_V3, 70_272),  # MLA: 61·(512 + 64)·2, no factor 2
    ("Mistral-7B-v0.1", MISTRAL_7B_V01, 131_072),  # sliding 4096 on every layer: the rate below it
    ("small-gqa", SMALL_GQA, 12_288),  # not in the registry
])
def test_analyze_takes_geometry_from_a_config_file(tmp_path: Path, lake: Path, folder: str,
                                                   fields: dict[str, Any], per_token: int) -> None:
    config = _config(tmp_path, folder, fields)
    rows = _analyze(lake, tmp_path / "a.duckdb", "--model-config", str(config))
    assert rows == [(folder, per_token, "given", per_token)]


def test_analyze_records_where_the_geometry_came_from(tmp_path: Path, lake: Path) -> None:
    # No model anywhere: the default is assumed, and the scenarios row says so.
    assert _analyze(lake, tmp_path / "a.duckdb") == [("llama-3.1-70b", 327_680, "default", 327_680)]
    assert _analyze(lake, tmp_path / "b.duckdb", "--model", "qwen2.5-7b") == [
        ("qwen2.5-7b", 57_344, "given", 57_344)]


def test_import_records_the_config_model_name_and_analyze_finds_it(tmp_path: Path, mooncake3: Path) -> None:
    config = _config(tmp_path, "Llama-3.1-8B", LLAMA_3_1_8B)
    lake, runner = tmp_path / "lake", CliRunner()
    result = runner.invoke(cli, ["import", "mooncake", str(mooncake3), "--lake", str(lake), "--scenario", "s",
                                 "--model-config", str(config)])
    assert result.exit_code == 0, result.output
    # the recorded name is the registry's Llama-3.1-8B, so a later analyze needs no flag
    assert _analyze(lake, tmp_path / "a.duckdb") == [("llama-3.1-8b", 131_072, "requests", 131_072)]


def test_simulate_takes_a_config_file(tmp_path: Path, lake: Path) -> None:
    config = _config(tmp_path, "small-gqa", SMALL_GQA)
    result = CliRunner().invoke(cli, ["simulate", "--lake", str(lake), "--from", "s", "--scenario", "w",
                                      "--replicas", "2", "--model-config", str(config)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("scenario 'w': ")


def test_probe_takes_a_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")  # the probe's own dependency (kvlens[gpu]); the CPU build runs here
    import kvlens.gpu_probe.timing as timing

    monkeypatch.setattr(timing, "cuda_available", lambda: False)
    config = _config(tmp_path, "small-gqa", SMALL_GQA)
    result = CliRunner().invoke(cli, ["probe", "--model-config", str(config), "--prefix-tokens", "32",
                                      "--quick"])
    assert result.exit_code == 0, result.output
    assert "probe small-gqa on cpu" in result.output


@pytest.mark.parametrize("command", [["analyze", "--lake", "LAKE", "--db", "DB"],
                                     ["import", "mooncake", "TRACE", "--lake", "LAKE"]])
def test_model_config_errors_are_one_line(tmp_path: Path, lake: Path, mooncake3: Path,
                                          command: list[str]) -> None:
    config = _config(tmp_path, "small-gqa", SMALL_GQA)
    fill = {"LAKE": str(lake), "DB": str(tmp_path / "x.duckdb"), "TRACE": str(mooncake3)}
    base = [fill.get(a, a) for a in command]
    both = CliRunner().invoke(cli, [*base, "--model", "llama-3.1-8b", "--model-config", str(config)])
    assert both.exit_code == 1 and both.output.startswith("Error: --model llama-3.1-8b and --model-config")
    missing = CliRunner().invoke(cli, [*base, "--model-config", str(tmp_path / "nope.json")])
    assert missing.exit_code == 1 and "nope.json' not found" in missing.output
    assert len(missing.output.strip().splitlines()) == 1
    bad = _config(tmp_path, "broken", {"model_type": "llama", "hidden_size": 768})
    broken = CliRunner().invoke(cli, [*base, "--model-config", str(bad)])
    assert broken.exit_code == 1 and "num_hidden_layers" in broken.output


def test_unknown_model_error_names_the_option_that_exists(tmp_path: Path, lake: Path) -> None:
    result = CliRunner().invoke(cli, ["analyze", "--lake", str(lake), "--db", str(tmp_path / "a.duckdb"),
                                      "--model", "my-private-model"])
    assert result.exit_code == 1 and "pass --model-config config.json" in result.output
    assert "--model-config" in CliRunner().invoke(cli, ["analyze", "--help"]).output
