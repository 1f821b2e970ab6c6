"""Tests for gpu_probe: KV layout and FLOP arithmetic, the byte gate, the delay-injection control,
the CPU fallback end to end (table, probe_runs rows, CLI), and gpu-marked CUDA checks."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import duckdb
import pytest
from click.testing import CliRunner

import kvlens.gpu_probe.timing as timing
from kvlens.cli import cli
from kvlens.errors import ConfigError
from kvlens.gpu_probe import (
    INTERMEDIATE_SIZES,
    DelayCheck,
    LayerShape,
    Measurement,
    ProbePath,
    ProbePlan,
    ProbeReport,
    layer_shape,
    parse_prefix_tokens,
    plan_probe,
    prefill_flops,
    probe_rows,
    render_table,
)
from kvlens.gpu_probe.device_check import acceptance
from kvlens.gpu_probe.kvpool import kv_layout, loaded_tokens
from kvlens.gpu_probe.prefill import layers_that_fit
from kvlens.gpu_probe.timing import import_torch
from kvlens.lake import open_lake
from kvlens.models import MODELS, from_hf_config, get_model

LLAMA_8B = get_model("llama-3.1-8b")


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")


@pytest.fixture
def torch() -> Any:
    return pytest.importorskip("torch")


# -- layout and arithmetic (no torch) ---------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_layout_bytes_match_the_geometry(name: str) -> None:
    model = MODELS[name]
    for tokens in (64, 4096, 8192):
        layers = kv_layout(model, tokens)
        assert len(layers) == model.num_layers
        assert sum(layer.nbytes for layer in layers) == model.kv_bytes(tokens)


def test_layout_of_llama_8b_is_the_paged_pool_shape() -> None:
    layers = kv_layout(LLAMA_8B, 4096)
    assert {layer.shape() for layer in layers} == {(2, 256, 16, 8, 128)}
    assert layers[0].nbytes == 2 * 256 * 16 * 8 * 128 * 2
    mla = kv_layout(get_model("deepseek-v3"), 32)[0]
    assert mla.shape() == (1, 2, 16, 1, 576)  # one latent, no factor 2


def test_loaded_tokens_are_full_blocks_only() -> None:
    assert loaded_tokens(LLAMA_8B, 100) == 96
    assert sum(layer.nbytes for layer in kv_layout(LLAMA_8B, 100)) == LLAMA_8B.kv_bytes(96)
    with pytest.raises(ConfigError, match="no full 16-token block"):
        loaded_tokens(LLAMA_8B, 15)


def test_prefill_flops_hand_computed() -> None:
    shape = LayerShape("tiny", hidden=4, heads=2, kv_heads=1, head_dim=2, intermediate=8, num_layers=3)
    # projections 2·3·4·(4 + 2·2) + 2·3·4·4 = 288; MLP 6·3·4·8 = 576; attention 2·2·2·3·4 = 96
    assert prefill_flops(shape, 3, layers=1) == 960
    assert prefill_flops(shape, 3) == 3 * 960
    # linear plus quadratic in the tokens: the cost model's a + b·T + c·T²
    f = [prefill_flops(shape, t) for t in (1, 2, 3, 4)]
    assert f[3] - 3 * f[2] + 3 * f[1] - f[0] == 0
    assert f[2] - 2 * f[1] + f[0] == 3 * 2 * 2 * 2 * 2


def test_layer_shape_real_widths_and_narrowed() -> None:
    shape = layer_shape(LLAMA_8B)
    assert (shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate,
            shape.num_layers) == (4096, 32, 8, 128, 14336, 32)
    assert shape.weight_elements == 4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336
    small = layer_shape(LLAMA_8B, width_divisor=8)
    assert (small.hidden, small.heads, small.kv_heads, small.intermediate) == (512, 4, 1, 1792)
    assert small.name == "llama-3.1-8b (1/8 width)" and small.head_dim == 128
    gemma = layer_shape(get_model("gemma-2-27b"), width_divisor=8)
    assert gemma.heads % gemma.kv_heads == 0
    assert set(INTERMEDIATE_SIZES) <= set(MODELS)


def test_layer_shape_refuses_mla_and_defaults_intermediate() -> None:
    with pytest.raises(ConfigError, match="multi-head latent attention"):
        layer_shape(get_model("deepseek-v3"))
    custom = from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 32, "hidden_size": 4096},
                            name="custom")
    assert layer_shape(custom).intermediate == 11008  # Llama-2-7B's: 8/3·4096 rounded up to 256


def test_layers_that_fit() -> None:
    shape = layer_shape(LLAMA_8B)
    per_layer = 2 * shape.weight_elements
    assert layers_that_fit(shape, free_bytes=10 * per_layer, share=0.5) == 5
    assert layers_that_fit(shape, free_bytes=1, share=0.5) == 1
    assert layers_that_fit(shape, free_bytes=10**15) == 32


def test_parse_and_plan() -> None:
    assert parse_prefix_tokens("4096, 16384") == (4096, 16384)
    assert parse_prefix_tokens(None) is None
    with pytest.raises(ConfigError, match="comma-separated"):
        parse_prefix_tokens("4k")
    gpu_plan = plan_probe(LLAMA_8B, cuda=True)
    assert gpu_plan.prefix_tokens == (4096, 16384, 32768, 65536) and gpu_plan.width_divisor == 1
    assert str(gpu_plan.source) == "gpu" and gpu_plan.prefill_layers is None
    cpu_plan = plan_probe(LLAMA_8B, [65536, 256, 128, 128], cuda=False)
    assert cpu_plan.prefix_tokens == (128, 256) and cpu_plan.dropped_tokens == (65536,)
    assert str(cpu_plan.source) == "cpu" and cpu_plan.width_divisor == 8
    assert plan_probe(LLAMA_8B, [65536], quick=True, cuda=False).prefix_tokens == (64, 128)
    with pytest.raises(ConfigError, match="no full"):
        plan_probe(LLAMA_8B, [8], cuda=False)


def test_import_torch_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    with pytest.raises(ConfigError, match="pip install"):
        import_torch()
    assert timing.cuda_available() is False


# -- table, rows and acceptance from a hand-made report (no torch) -----------------------------


def _report(*, batched_ms: float = 1.0, exact: bool = True, control_exact: bool = False,
            prefill_tflops: float = 60.0) -> ProbeReport:
    plan = ProbePlan(LLAMA_8B, "cuda", (16384,), 1, 3, None, 1, 8192)
    n = LLAMA_8B.kv_bytes(16384)

    def m(path: ProbePath, ms: float, ok: bool | None = True) -> Measurement:
        return Measurement(path, "llama-3.1-8b", 16384, n, ms, n / ms / 1e6, ok, ts_ns=1)

    ms = {"h2d_pinned": 0.9, "h2d_pageable": 2.0, "d2h": 1.0, "d2d": 0.1, "kv_load_per_block": 5.0}
    measured = [Measurement(ProbePath.MATMUL_BF16, "llama-3.1-8b", 8192, None, 1.0, tflops=100.0)]
    measured += [m(ProbePath(p), v) for p, v in ms.items()]
    measured += [m(ProbePath.KV_LOAD_BATCHED, batched_ms, exact),
                 Measurement(ProbePath.PREFILL, "llama-3.1-8b", 16384, n, 2.0, tflops=prefill_tflops)]
    return ProbeReport(plan, "run1", "H200", tuple(measured), DelayCheck(True, control_exact, "1 cycle"),
                       None)


def test_table_has_the_issue_columns_and_the_verdict() -> None:
    table = render_table(_report(batched_ms=1.0))
    lines = table.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("prefix_tokens"))
    for column in ("kv_bytes", "cold_prefill_ms", "load_ms:batched", "load_ms:per_block",
                   "load_ms:pinned", "load_beats_recompute"):
        assert column in header
    row = lines[lines.index(header) + 1].split()
    assert row[0] == "16,384" and row[1] == f"{LLAMA_8B.kv_bytes(16384):,}" and row[-1] == "yes"
    assert "unordered control caught yes" in table
    slow = render_table(_report(batched_ms=3.0))
    assert slow.splitlines()[lines.index(header) + 1].split()[-1] == "no"


def test_rows_carry_the_probe_runs_columns() -> None:
    rows = probe_rows(_report())
    assert len(rows) == 8
    assert {r["path"] for r in rows} == {str(p) for p in ProbePath}
    assert all(r["source"] == "gpu" and r["device"] == "H200" and r["run_id"] == "run1" for r in rows)
    prefill = next(r for r in rows if r["path"] == "prefill")
    assert prefill["prefix_tokens"] == 16384 and prefill["gbps"] is None and prefill["byte_exact"] is None


def test_acceptance_lines_pass_and_fail() -> None:
    lines, ok = acceptance(_report(batched_ms=1.0))  # 0.9 / 1.0 of pinned, 60 / 100 TFLOP/s
    assert ok and all(line.startswith("PASS") for line in lines) and len(lines) == 3
    assert "0.900" in lines[0] and "0.600" in lines[1]
    assert acceptance(_report(batched_ms=1.2))[0][0].startswith("FAIL")  # 0.75 of pinned
    assert acceptance(_report(prefill_tflops=40.0))[0][1].startswith("FAIL")
    lines, ok = acceptance(_report(exact=False))
    assert not ok and "kv_load_batched@16384" in lines[2]
    assert not acceptance(_report(control_exact=True))[1]  # a gate that cannot fail is no gate
    assert not _report(control_exact=True).byte_exact and _report().byte_exact


# -- the byte gate (torch, CPU) ---------------------------------------------------------------


def test_gate_compares_bytes_not_floats(torch: Any) -> None:
    from kvlens.gpu_probe.kvpool import bytes_equal, poison_

    a = torch.tensor([0.0, 1.0], dtype=torch.bfloat16)
    b = torch.tensor([-0.0, 1.0], dtype=torch.bfloat16)
    assert torch.equal(a, b) and not bytes_equal(a, b)  # equal as floats, not as bytes
    nan = torch.tensor([float("nan")], dtype=torch.bfloat16)
    assert not torch.equal(nan, nan) and bytes_equal(nan, nan.clone())
    big = torch.randn(1000, dtype=torch.bfloat16)
    flipped = big.clone()
    flipped.view(torch.uint8)[1537] ^= 1
    assert bytes_equal(big, big.clone(), chunk_bytes=64)
    assert not bytes_equal(big, flipped, chunk_bytes=64)
    poison_(flipped)
    assert set(flipped.view(torch.uint8).tolist()) == {0xA5}


def test_both_load_paths_install_the_blocks_and_the_gate_catches_misses(torch: Any) -> None:
    from kvlens.gpu_probe.kvpool import allocate_kv, gate_kv, load_batched, load_per_block, poison_kv

    buf = allocate_kv(LLAMA_8B, 64, device="cpu")
    assert buf.nbytes == LLAMA_8B.kv_bytes(64)
    assert bool((buf.host != 0).any()) and len(set(buf.ids_list[0])) == 4
    for load in (load_batched, load_per_block):
        poison_kv(buf)
        assert not gate_kv(buf)  # nothing installed yet: the poisoned pool fails
        load(buf)
        assert gate_kv(buf)
        buf.pools[7][1, buf.ids_list[7][3], 15, 7, 127] += 1  # one element of one V block
        assert not gate_kv(buf)


def test_delay_injection_on_cpu_ordered_exact_and_control_caught(torch: Any) -> None:
    from kvlens.gpu_probe.transfer import delay_injection_check

    check = delay_injection_check(LLAMA_8B, device="cpu", delay_s=0.2)
    assert check.ordered_exact is True
    assert check.control_exact is False
    assert check.passed and check.delay == "0.2 s"


def test_measure_transfers_on_cpu(torch: Any) -> None:
    from kvlens.gpu_probe.transfer import measure_transfers

    rows = measure_transfers(LLAMA_8B, 40, device="cpu", warmup=0, runs=2)
    assert [r.path for r in rows] == [ProbePath.H2D_PINNED, ProbePath.H2D_PAGEABLE, ProbePath.D2H,
                                      ProbePath.D2D, ProbePath.KV_LOAD_BATCHED, ProbePath.KV_LOAD_PER_BLOCK]
    for r in rows:
        assert r.byte_exact is True and r.prefix_tokens == 40 and len(r.runs_ms) == 2
        assert r.kv_bytes == LLAMA_8B.kv_bytes(32)  # full blocks only
        assert r.ms > 0 and r.gbps == pytest.approx(r.kv_bytes / r.ms / 1e6)


# -- prefill (torch, CPU) ---------------------------------------------------------------------


def _reference_attention(torch: Any, q: Any, k: Any, v: Any) -> Any:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1).float(), v.repeat_interleave(groups, dim=1).float()
    scores = q.float() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    t = q.shape[2]
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def test_attention_is_causal_gqa(torch: Any) -> None:
    from kvlens.gpu_probe.prefill import pick_attention

    shape = LayerShape("t", hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, num_layers=1)
    name, attention = pick_attention(shape, "cpu", torch.float32)
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 9, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    assert name == "sdpa gqa"
    assert torch.allclose(attention(q, k, v), _reference_attention(torch, q, k, v), atol=1e-5)


def test_layer_stack_is_random_and_finite(torch: Any) -> None:
    from kvlens.gpu_probe.prefill import _layer, _weights, pick_attention

    shape = layer_shape(LLAMA_8B, width_divisor=16)
    weights = _weights(shape, 2, "cpu", torch.bfloat16)
    assert all(bool((w != 0).all()) if key.startswith("norm") else bool((w != 0).any())
               for layer in weights for key, w in layer.items())
    _, attention = pick_attention(shape, "cpu", torch.bfloat16)
    x = torch.randn(24, shape.hidden, dtype=torch.bfloat16)
    y = _layer(x, weights[0], shape, attention)
    assert y.shape == x.shape and bool(torch.isfinite(y).all()) and not torch.equal(x, y)


def test_measure_prefill_and_matmul_on_cpu(torch: Any) -> None:
    from kvlens.gpu_probe.prefill import measure_matmul, measure_prefill

    setup, rows = measure_prefill(LLAMA_8B, [32, 64], device="cpu", layers=1, width_divisor=16,
                                  warmup=0, runs=1)
    assert setup.layers_run == 1 and setup.shape.num_layers == 32
    assert [r.prefix_tokens for r in rows] == [32, 64]
    for r, tokens in zip(rows, (32, 64), strict=True):
        assert r.path == ProbePath.PREFILL and r.model == "llama-3.1-8b (1/16 width)"
        assert r.kv_bytes == LLAMA_8B.kv_bytes(tokens) and r.ms > 0
        assert r.tflops == pytest.approx(prefill_flops(setup.shape, tokens) / r.ms / 1e9)
    mm = measure_matmul(64, device="cpu", model="m", warmup=0, runs=1)
    assert mm.path == ProbePath.MATMUL_BF16 and mm.prefix_tokens == 64 and mm.model == "m"
    assert mm.tflops == pytest.approx(2 * 64**3 / mm.ms / 1e9)


# -- the CPU fallback end to end --------------------------------------------------------------


def test_run_probe_on_cpu_writes_probe_runs(torch: Any, tmp_path: Path) -> None:
    from kvlens.gpu_probe import run_probe, write_probe_rows

    report = run_probe(plan_probe(LLAMA_8B, [32], quick=True, cuda=False))
    assert report.byte_exact and report.delay.passed
    assert report.device_name == "cpu" and report.prefill is not None
    assert write_probe_rows(report, tmp_path / "lake") == 8
    con = duckdb.connect()
    open_lake(con, tmp_path / "lake")
    got = con.execute("SELECT scenario, path, source, prefix_tokens, byte_exact, model FROM probe_runs "
                      "ORDER BY path").fetchall()
    assert [g[1] for g in got] == sorted(str(p) for p in ProbePath)
    assert {(g[0], g[2]) for g in got} == {("probe", "cpu")}
    assert all(g[4] is True for g in got if g[1] not in ("prefill", "matmul_bf16"))
    assert ("prefill", 32, "llama-3.1-8b (1/8 width)") in {(g[1], g[3], g[5]) for g in got}


def test_cli_probe_without_cuda(torch: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timing, "cuda_available", lambda: False)
    lake = tmp_path / "lake"
    result = CliRunner().invoke(cli, ["probe", "--model", "qwen2.5-7b", "--prefix-tokens", "32",
                                      "--quick", "--lake", str(lake)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("CUDA is not available") and "source=cpu" in lines[0]
    assert lines[1].startswith("probe qwen2.5-7b on cpu (source=cpu)")
    assert "load_beats_recompute" in result.output
    assert lines[-1].startswith("wrote 8 probe_runs rows")
    assert list((lake / "probe_runs" / "scenario=probe").rglob("*.parquet"))


def test_cli_probe_bad_prefix_is_one_error_line(torch: Any) -> None:
    result = CliRunner().invoke(cli, ["probe", "--prefix-tokens", "4k"])
    assert result.exit_code == 1
    assert result.output.startswith("Error:") and len(result.output.strip().splitlines()) == 1


# -- CUDA (gpu marker) ------------------------------------------------------------------------


@gpu
@needs_cuda
def test_delay_injection_on_cuda(torch: Any) -> None:
    from kvlens.gpu_probe.transfer import delay_injection_check

    check = delay_injection_check(LLAMA_8B, device="cuda", prefix_tokens=256)
    assert check.ordered_exact is True
    assert check.control_exact is False


@gpu
@needs_cuda
def test_transfers_on_cuda_are_byte_exact(torch: Any) -> None:
    from kvlens.gpu_probe.transfer import measure_transfers

    rows = measure_transfers(LLAMA_8B, 1024, device="cuda", warmup=1, runs=2)
    assert len(rows) == 6 and all(r.byte_exact for r in rows)
    assert all(r.kv_bytes == LLAMA_8B.kv_bytes(1024) and r.gbps and r.gbps > 0 for r in rows)


@gpu
@needs_cuda
def test_prefill_on_cuda_uses_a_fast_attention_backend(torch: Any) -> None:
    from kvlens.gpu_probe.prefill import measure_matmul, measure_prefill

    setup, rows = measure_prefill(LLAMA_8B, [2048], device="cuda", layers=2, warmup=1, runs=2)
    assert "cudnn" in setup.attention or "flash" in setup.attention
    assert rows[0].tflops and rows[0].tflops > 0
    assert (measure_matmul(4096, device="cuda", warmup=1, runs=2).tflops or 0.0) > 0
