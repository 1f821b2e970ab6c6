"""Miss-ratio curves: a pure-Python LRU oracle, libCacheSim on the Mooncake trace, SHARDS error."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import duckdb
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from multiturn import multiturn_blocks

from kvlens.analyzers.mrc import (
    curve,
    exact_histogram,
    merge,
    mrc,
    partition_histograms,
    shards_histogram,
)
from kvlens.analyzers.partitions import Partitions
from kvlens.analyzers.reuse import key_hashes, request_stream
from kvlens.lake import open_lake
from kvlens.schema import MRC

TRACE = Path(__file__).resolve().parents[1] / "sample_data" / "conversation_trace.jsonl.gz"


def lru_oracle(keys: list[int], sizes: list[int], capacity: int) -> tuple[int, int]:
    """(hits, hit bytes) of a byte-capacity LRU: evict from the tail until the newcomer fits."""
    cache: OrderedDict[int, int] = OrderedDict()
    used = hits = hit_bytes = 0
    for k, s in zip(keys, sizes, strict=True):
        if k in cache:
            hits += 1
            hit_bytes += s
            used -= cache.pop(k)
        if s > capacity:
            continue
        cache[k] = s
        used += s
        while used > capacity:
            used -= cache.popitem(last=False)[1]
    return hits, hit_bytes


def test_six_accesses_curve_by_hand() -> None:
    h = exact_histogram(np.array([1, 2, 1, 3, 2, 1]), np.array([10, 20, 10, 30, 20, 10]))
    hr, hrb = curve(h, [29, 30, 59, 60], by="bytes")  # distances 30, 60, 60; total 100 bytes
    assert hr.tolist() == [0, 1 / 6, 1 / 6, 3 / 6]
    assert hrb.tolist() == [0, 0.1, 0.1, 0.4]
    assert curve(h, [1, 2, 3], by="blocks")[0].tolist() == [0, 1 / 6, 3 / 6]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 15), min_size=1, max_size=200),
       st.lists(st.integers(1, 8), min_size=16, max_size=16),
       st.lists(st.integers(8, 60), min_size=1, max_size=5))
def test_curve_matches_python_lru(keys: list[int], size_of: list[int], capacities: list[int]) -> None:
    # One size per block and capacities at least the largest block (8): where the model is exact.
    sizes = [size_of[k] for k in keys]
    h = exact_histogram(np.array(keys), np.array(sizes))
    hr, hrb = curve(h, capacities, by="bytes")
    unit_hr, _ = curve(h, capacities, by="blocks")
    for i, c in enumerate(capacities):
        hits, hit_bytes = lru_oracle(keys, sizes, c)
        assert hr[i] == pytest.approx(hits / len(keys))
        assert hrb[i] == pytest.approx(hit_bytes / sum(sizes))
        assert unit_hr[i] == pytest.approx(lru_oracle(keys, [1] * len(keys), c)[0] / len(keys))


@pytest.fixture(scope="module")
def conv(tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[np.ndarray, np.ndarray, duckdb.DuckDBPyConnection]:
    from kvlens.collector.importer import import_files

    lake = tmp_path_factory.mktemp("lake")
    import_files("mooncake", [TRACE], lake, scenario="conv")
    con = duckdb.connect()
    open_lake(con, lake)
    rs = request_stream(con.table("request_blocks"))
    return rs["block_hash"].to_numpy(), rs["block_tokens"].to_numpy().astype(np.int64), con


def _libcachesim_lru(path: Path, keys: np.ndarray, sizes: np.ndarray, capacities: list[int]
                     ) -> list[tuple[float, float]]:
    lcs = pytest.importorskip("libcachesim")
    rec = np.zeros(len(keys), np.dtype([("t", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")]))
    rec["t"], rec["id"], rec["size"], rec["next"] = np.arange(len(keys)) // 1000, keys, sizes, -1
    rec.tofile(path)
    out = []
    for c in capacities:
        reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
        out.append(lcs.LRU(c).process_trace(reader))
    return out


def test_exact_curve_equals_libcachesim_on_mooncake(conv, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    keys, tokens, _ = conv
    h_unit = exact_histogram(keys, 1)
    h_sized = exact_histogram(keys, tokens)
    caps_blocks = [1, 10, 100, 1_000, 3_000, 10_000, 20_000, 40_000, 80_000, 120_000, 200_000]
    unit = _libcachesim_lru(tmp_path / "unit.bin", keys, np.ones(len(keys), np.int64), caps_blocks)
    hr, _ = curve(h_unit, caps_blocks, by="blocks")
    ours = np.round(hr * len(keys)).astype(int)
    theirs = [round((1 - miss) * len(keys)) for miss, _ in unit]
    assert ours.tolist() == theirs
    assert len(set(theirs)) > 5  # the capacities span the curve
    caps_tokens = [c * 512 for c in caps_blocks] + [1_000_000 + 77]
    sized = _libcachesim_lru(tmp_path / "sized.bin", keys, tokens, caps_tokens)
    hr, hrb = curve(h_sized, caps_tokens, by="bytes")
    for i, (miss, byte_miss) in enumerate(sized):
        assert 1 - hr[i] == pytest.approx(miss, abs=1e-12)
        assert 1 - hrb[i] == pytest.approx(byte_miss, abs=1e-12)


def lru_slots(keys: list[int], capacity: int) -> int:
    """Hits of an LRU of ``capacity`` slots, one block per slot."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for k in keys:
        if k in cache:
            hits += 1
            cache.move_to_end(k)
        else:
            cache[k] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def test_exact_curve_is_an_lru_of_c_slots_on_a_multiturn_trace(tmp_path: Path) -> None:
    """Every capacity the exact curve reports equals an LRU of that many slots over the full blocks
    (arrival order, then position), by libCacheSim and by a Python LRU; partial tails never count."""
    rb = multiturn_blocks(sessions=40, turns=6, block_size=16, repeats=5, seed=3)
    assert 0 < (rb["block_tokens"] < rb["block_size_tokens"]).sum() < rb.height  # tails, some repeated
    full = rb.filter(rb["block_tokens"] == rb["block_size_tokens"]).sort("arrival_ns", "request_id",
                                                                         "position")
    keys = full["block_hash"].to_list()
    con = duckdb.connect()
    out = mrc(request_blocks=con.from_arrow(rb.to_arrow()), bytes_per_token=327_680, scenario="mt")
    exact = out.filter(method="exact")
    caps = exact["capacity_blocks"].to_list()
    assert caps == list(range(1, len(caps) + 1)) and len(caps) > 50  # every capacity up to saturation
    assert exact["capacity_bytes"].to_list() == [c * 16 * 327_680 for c in caps]
    ours = np.round(exact["hit_ratio_blocks"].to_numpy() * len(keys)).astype(int).tolist()
    assert ours == [lru_slots(keys, c) for c in caps]
    assert exact["hit_ratio_bytes"].to_list() == exact["hit_ratio_blocks"].to_list()  # one size per slot
    arr = np.array(keys, dtype=np.uint64)
    theirs = _libcachesim_lru(tmp_path / "mt.bin", arr, np.ones(len(keys), np.int64), caps)
    assert ours == [round((1 - miss) * len(keys)) for miss, _ in theirs]
    assert len(set(ours)) > 20  # the capacities span the curve


def _linear_mae(exact: object, est: object, top: float) -> float:
    caps = np.linspace(top / 100, top, 100)
    return float(np.abs(curve(exact, caps)[1] - curve(est, caps)[1]).mean())  # type: ignore[arg-type]


def test_shards_adj_rate_001_on_mooncake(conv) -> None:  # type: ignore[no-untyped-def]
    keys, tokens, _ = conv
    exact = exact_histogram(keys, tokens)
    top = float(exact.distance_bytes.max())
    maes = [_linear_mae(exact, shards_histogram(keys, tokens, rate=0.01, seed=s), top) for s in range(3)]
    assert max(maes) < 0.01, maes
    fixed = shards_histogram(keys, tokens, max_keys=4_000)
    assert _linear_mae(exact, fixed, top) < 0.01


def zipf_stream(n: int, keys: int, alpha: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, keys + 1) ** alpha
    ranks = rng.choice(keys, size=n, p=p / p.sum())
    return rng.permutation(keys).astype(np.uint64)[ranks] * np.uint64(2654435761)


def test_oversized_block_is_where_the_stack_model_stops() -> None:
    # Block 2 (10 bytes) cannot fit a 5-byte cache: a real LRU bypasses it and keeps block 1,
    # the stack model counts its bytes. Curves are exact from the largest block size up.
    h = exact_histogram(np.array([1, 2, 1]), np.array([1, 10, 1]))
    assert lru_oracle([1, 2, 1], [1, 10, 1], 5)[0] == 1
    assert curve(h, [5])[0][0] == 0.0
    assert curve(h, [10, 11])[0].tolist() == [0.0, 1 / 3]


def test_shards_adj_rate_001_on_zipf() -> None:
    keys = zipf_stream(1_000_000, 1_000_000, 1.0, seed=1)
    exact = exact_histogram(keys, 1)
    top = float(exact.distance_bytes.max())
    for s in range(3):
        assert _linear_mae(exact, shards_histogram(keys, 1, rate=0.01, seed=s), top) < 0.01
    assert _linear_mae(exact, shards_histogram(keys, 1, max_keys=8_000), top) < 0.01
    unadjusted = [_linear_mae(exact, shards_histogram(keys, 1, rate=0.01, seed=s, adjust=False), top)
                  for s in range(3)]
    adjusted = [_linear_mae(exact, shards_histogram(keys, 1, rate=0.01, seed=s), top) for s in range(3)]
    assert sum(adjusted) <= sum(unadjusted)


def test_shards_at_rate_one_is_exact_and_adj_restores_totals() -> None:
    keys = zipf_stream(20_000, 3_000, 1.0, seed=2)
    exact = exact_histogram(keys, 1)
    full = shards_histogram(keys, 1, rate=1.0)
    caps = np.arange(1, 3_001, 50)
    assert np.allclose(curve(exact, caps)[0], curve(full, caps)[0])
    assert np.allclose(curve(exact, caps)[0], curve(shards_histogram(keys, 1, max_keys=10_000), caps)[0])
    sampled = shards_histogram(keys, 1, rate=0.05)
    raw = shards_histogram(keys, 1, rate=0.05, adjust=False)
    # adj: one record of N - N_sampled/R references at the smallest distance
    n_sampled = int((key_hashes(keys, np.uint64(0)) < np.uint64(int(0.05 * 2**64))).sum())
    assert sampled.weight[-1] == pytest.approx(len(keys) - n_sampled / 0.05)
    assert sampled.weight[:-1].sum() == pytest.approx(raw.weight.sum())
    assert curve(sampled, [1e12])[0][0] == pytest.approx(curve(exact, [1e12])[0][0], abs=0.05)


def test_partitions_merge() -> None:
    keys = zipf_stream(50_000, 5_000, 0.9, seed=4)
    exact = exact_histogram(keys, 1)
    caps = np.linspace(50, 5_000, 100)
    one = merge(*partition_histograms(keys, 1, partitions=1))
    assert np.allclose(curve(one, caps)[0], curve(exact, caps)[0])
    parts = partition_histograms(keys, 1, partitions=8)
    merged = merge(*parts)
    assert merged.total_accesses == pytest.approx(8 * len(keys))
    assert np.abs(curve(merged, caps)[0] - curve(exact, caps)[0]).mean() < 0.01
    assert np.allclose(curve(merge(merge(*parts[:3]), merge(*parts[3:])), caps)[0], curve(merged, caps)[0])


def test_mrc_table(conv) -> None:  # type: ignore[no-untyped-def]
    _, _, con = conv
    out = mrc(request_blocks=con.table("request_blocks"), bytes_per_token=327_680, scenario="conv",
              sample_rate=0.01)
    assert out.columns == list(MRC.names)
    assert set(out["method"]) == {"exact", "shards"}
    exact = out.filter(method="exact")
    assert exact["capacity_bytes"].to_list() == (exact["capacity_blocks"] * 512 * 327_680).to_list()
    assert exact["hit_ratio_blocks"].is_sorted() and exact["hit_ratio_bytes"].is_sorted()
    assert 150 <= exact.height <= 210
    # at the last grid point every re-access hits: 105,592 re-accesses of the 276,491 full blocks
    # (the 12,009 partial tails, 118 of them repeated prompts, are never cached)
    assert exact["hit_ratio_blocks"][-1] == pytest.approx(105_592 / 276_491)


def test_mrc_partitioned_rows(conv) -> None:  # type: ignore[no-untyped-def]
    """``partitions`` adds the curve merged from K hash partitions on the exact rows' grid: equal
    to the exact curve for K = 1; for K = 8 (each partition a 12.5% spatial sample) within the
    error of a SHARDS estimate at that rate on the Mooncake conversation trace (measured: mean
    absolute error 0.00055 over 169 capacities, at most 0.0101 at the smallest)."""
    _, _, con = conv
    seen: list[int] = []

    def counting(fn, parts):  # type: ignore[no-untyped-def]
        for args in parts:
            seen.append(len(args[0]))
            yield fn(*args)

    for count, mean, most in ((1, 0.0, 0.0), (8, 0.003, 0.02)):
        seen.clear()
        out = mrc(request_blocks=con.table("request_blocks"), bytes_per_token=327_680, scenario="conv",
                  partitions=Partitions(count, counting))
        assert set(out["method"]) == {"exact", "partitioned"}
        exact, merged = out.filter(method="exact"), out.filter(method="partitioned")
        assert merged["capacity_blocks"].to_list() == exact["capacity_blocks"].to_list()
        assert len(seen) == count and sum(seen) == 276_491  # every full-block access, once
        gap = (merged["hit_ratio_blocks"] - exact["hit_ratio_blocks"]).abs()
        assert gap.mean() <= mean + 1e-12 and gap.max() <= most + 1e-12, (count, gap.mean(), gap.max())
        if count > 1:
            assert gap.max() > 0  # a sample: not the exact curve by accident
