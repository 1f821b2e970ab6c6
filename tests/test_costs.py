"""Tests for analyzers/costs.py and analyzers/crossover.py: calibration, labels, T_remote by hand."""

from __future__ import annotations

from typing import Any

import duckdb
import polars as pl
import pytest

from kvlens.analyzers.costs import (
    DEFAULT_DEVICE,
    CostModel,
    DeviceModel,
    Label,
    LoadPath,
    cost_model,
    prefill_ms,
    useful_remote_tokens,
)
from kvlens.analyzers.crossover import CROSSOVER_TOKENS, crossover
from kvlens.models import get_model
from kvlens.schema import TABLES

MODEL = get_model("llama-3.1-8b")
TOKENS = (1024, 2048, 4096, 8192, 16384)
A, B, C = 4.0, 0.02, 3e-7  # ms, ms/token, ms/token²

# Round numbers: 1 GB moves in 100 ms over the network, 50 ms over H2D, 25 ms to install.
DEVICE = DeviceModel(name="test device", pool_gbps=10.0, pool_lookup_ms=1.0, pool_queue_ms=2.0,
                     peer_gbps=5.0, peer_lookup_ms=0.5, local_lookup_ms=0.1, h2d_gbps=20.0,
                     d2h_gbps=10.0, install_gbps=40.0)


def _row(run_id: str, ts_ns: int, path: str, tokens: int, ms: float, *, source: str = "gpu",
         model: str = MODEL.name, device: str = "NVIDIA H200", kv_bytes: int | None = None,
         exact: bool | None = None) -> dict[str, Any]:
    return {"run_id": run_id, "scenario": "probe", "ts_ns": ts_ns, "device": device, "path": path,
            "model": model, "prefix_tokens": tokens, "kv_bytes": kv_bytes, "ms": ms, "gbps": None,
            "byte_exact": exact, "source": source}


def _prefill_rows(run_id: str, ts_ns: int, a: float, b: float, c: float, **kw: Any) -> list[dict[str, Any]]:
    return [_row(run_id, ts_ns + i, "prefill", t, a + b * t + c * t * t, **kw) for i, t in enumerate(TOKENS)]


def _relation(rows: list[dict[str, Any]]) -> duckdb.DuckDBPyRelation:
    con = duckdb.connect()
    schema: dict[str, type[pl.DataType]] = {c.name: pl.String for c in TABLES["probe_runs"].columns}
    schema |= {"ts_ns": pl.Int64, "prefix_tokens": pl.Int64, "kv_bytes": pl.Int64, "ms": pl.Float64,
               "gbps": pl.Float64, "byte_exact": pl.Boolean}
    con.register("probe_runs", pl.DataFrame(rows, schema=schema))
    return con.table("probe_runs")


def test_fit_recovers_a_known_quadratic() -> None:
    costs = cost_model(probe_runs=_relation(_prefill_rows("r1", 10, A, B, C)), model=MODEL, device=DEVICE)
    assert costs.fit == pytest.approx((A, B, C), rel=1e-6)
    assert costs.device_name == "NVIDIA H200" and costs.fit_run_id == "r1"
    ms, label = costs.recompute_ms(3000)
    assert ms == pytest.approx(A + B * 3000 + C * 3000**2) and label is Label.MEASURED
    # After 1000 cached tokens: a + b·2000 + c·(3000² − 1000²); the saving leaves the call's a.
    assert costs.recompute_ms(2000, 1000)[0] == pytest.approx(A + B * 2000 + C * (3000**2 - 1000**2))
    assert costs.saved_recompute_ms(2000, 1000)[0] == pytest.approx(B * 2000 + C * (3000**2 - 1000**2))
    assert not costs.extrapolated(16384) and costs.extrapolated(131072)


def test_newest_gpu_run_of_the_same_model_wins() -> None:
    rows = (_prefill_rows("old", 10, 1.0, 0.5, 0.0) + _prefill_rows("new", 1000, A, B, C)
            + _prefill_rows("cpu", 5000, 9.0, 9.0, 9.0, source="cpu")
            + _prefill_rows("other", 6000, 7.0, 7.0, 7.0, model="qwen2.5-7b"))
    costs = cost_model(probe_runs=_relation(rows), model=MODEL, device=DEVICE)
    assert costs.fit == pytest.approx((A, B, C), rel=1e-6) and costs.fit_run_id == "new"


def test_cpu_rows_never_calibrate_a_gpu_device() -> None:
    h2d = _row("cpu", 20, "h2d_pinned", 1024, 1.0, source="cpu", kv_bytes=10**9, exact=True)
    rows = [*_prefill_rows("cpu", 10, A, B, C, source="cpu"), h2d]
    costs = cost_model(probe_runs=_relation(rows), model=MODEL, device=DEVICE)
    assert costs.fit is None and costs.device_name == "test device"
    ms, label = costs.recompute_ms(4096)
    assert label is Label.MODELLED and ms == pytest.approx(prefill_ms(MODEL, 4096, 0, DEVICE))
    assert costs.h2d.label is Label.MODELLED and costs.h2d.gbps == 20.0


def test_without_probe_rows_everything_is_modelled() -> None:
    for relation in (None, _relation([])):
        costs = cost_model(probe_runs=relation, model=MODEL)
        assert costs.device_name == DEFAULT_DEVICE.name
        assert costs.recompute_ms(512)[1] is Label.MODELLED
        assert all(costs.remote(10**9, p).label is Label.MODELLED for p in LoadPath)


def test_two_prefill_lengths_are_not_enough_to_fit() -> None:
    rows = _prefill_rows("r", 10, A, B, C)[:2]
    assert cost_model(probe_runs=_relation(rows), model=MODEL, device=DEVICE).fit is None


def test_t_remote_is_the_sum_of_its_terms_by_hand() -> None:
    costs = cost_model(probe_runs=None, model=MODEL, device=DEVICE)
    gb = 10**9
    pool = costs.remote(gb, LoadPath.POOL)
    # lookup 1 + queue 2 + 1 GB at 10 GB/s (100) + stage at 20 GB/s (50) + install at 40 GB/s (25)
    assert (pool.lookup_ms, pool.queue_ms, pool.transfer_ms, pool.stage_ms, pool.install_ms) == pytest.approx(
        (1.0, 2.0, 100.0, 50.0, 25.0))
    assert costs.remote_ms(gb, LoadPath.POOL) == (pytest.approx(178.0), Label.MODELLED)
    assert costs.remote_ms(gb, LoadPath.PEER)[0] == pytest.approx(0.5 + 200.0 + 50.0 + 25.0)
    # The local tier is already in host memory: its transfer is the H2D copy, nothing staged.
    assert costs.remote_ms(gb, LoadPath.LOCAL_TIER)[0] == pytest.approx(0.1 + 50.0 + 25.0)
    # Publishing: D2H at 10 GB/s, then the network and a lookup.
    assert costs.write_ms(gb, LoadPath.POOL)[0] == pytest.approx(1.0 + 100.0 + 100.0)
    assert costs.write_ms(gb, LoadPath.LOCAL_TIER)[0] == pytest.approx(0.1 + 100.0)


def test_measured_bandwidths_label_the_local_path_measured() -> None:
    sizes = [(1024, 10**8), (4096, 4 * 10**8), (16384, 16 * 10**8)]
    # H2D at 20 GB/s plus 0.01 ms fixed; the paged load adds an install at 40 GB/s.
    rows = [_row("r", 10, "h2d_pinned", t, 0.01 + s / 20e6, kv_bytes=s, exact=True) for t, s in sizes]
    rows += [_row("r", 10, "kv_load_batched", t, 0.01 + s / 20e6 + s / 40e6, kv_bytes=s, exact=True)
             for t, s in sizes]
    rows += [_row("r", 10, "d2h", t, s / 1e6, kv_bytes=s, exact=False) for t, s in sizes]  # not exact
    costs = cost_model(probe_runs=_relation(rows), model=MODEL, device=DEVICE)
    assert costs.h2d.gbps == pytest.approx(20.0) and costs.h2d.fixed_ms == pytest.approx(0.01, abs=1e-6)
    assert costs.install.gbps == pytest.approx(40.0) and costs.install.label is Label.MEASURED
    assert costs.d2h.label is Label.MODELLED  # the copies that were not byte-exact measured nothing
    local = costs.remote(10**9, LoadPath.LOCAL_TIER)
    assert local.label is Label.MEASURED
    assert local.total_ms == pytest.approx(0.1 + 0.01 + 50.0 + 25.0, rel=1e-6)
    assert costs.remote(10**9, LoadPath.POOL).label is Label.MODELLED  # the network is configured
    assert costs.recompute_ms(1024)[1] is Label.MODELLED  # no prefill rows: FLOP model


def test_useful_remote_tokens_are_whole_blocks() -> None:
    assert useful_remote_tokens(1000, 256) == 768
    assert useful_remote_tokens(255, 256) == 0
    assert useful_remote_tokens(512, 256) == 512


def test_crossover_table_matches_schema_and_picks_the_faster() -> None:
    costs = cost_model(probe_runs=_relation(_prefill_rows("r1", 10, A, B, C)), model=MODEL, device=DEVICE)
    table = crossover(costs=costs, scenario="s")
    assert tuple(table.columns) == TABLES["crossover"].names
    assert table.height == len(CROSSOVER_TOKENS) * len(LoadPath)
    assert set(table["recompute_label"]) == {"measured"} and set(table["load_label"]) == {"modelled"}
    for row in table.iter_rows(named=True):
        assert row["winner"] == ("load" if row["load_ms"] < row["recompute_ms"] else "recompute")
        assert row["kv_bytes"] == MODEL.kv_bytes(row["prefix_tokens"])
        t = row["prefix_tokens"]
        assert row["recompute_ms"] == pytest.approx(A + B * t + C * t * t)
        assert row["recompute_extrapolated"] == (not min(TOKENS) <= t <= max(TOKENS))


def test_modelled_crossover_is_the_flop_model() -> None:
    costs = CostModel(MODEL, DEFAULT_DEVICE, DEFAULT_DEVICE.name)
    table = crossover(costs=costs, scenario="s", tokens=(512,))
    assert table["recompute_ms"][0] == pytest.approx(prefill_ms(MODEL, 512))
    assert set(table["recompute_label"]) == {"modelled"}
