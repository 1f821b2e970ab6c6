"""Effective capacity on the curve, and reuse interval against TTL, on hand-computed cases."""

from __future__ import annotations

from pathlib import Path

import duckdb
import polars as pl
import pytest

from kvlens.analyzers.capacity import effective_capacity, ttl_coverage
from kvlens.errors import ConfigError, NoDataError

S = 1_000_000_000


def _curve() -> pl.DataFrame:
    return pl.DataFrame({
        "scenario": "s", "stream": "requests", "method": "exact", "capacity_blocks": [1, 5, 10, 11],
        "capacity_bytes": [100, 500, 1000, 1100], "hit_ratio_blocks": [0.1, 0.3, 0.5, 0.6],
        "hit_ratio_bytes": [0.1, 0.3, 0.5, 0.6],
    })


def _metrics(con: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyRelation:
    return con.from_arrow(pl.DataFrame({
        "ts_ns": [1, 2, 1, 1], "scenario": ["s", "s", "s", "t"], "replica": "a",
        "name": ["vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc"],
        "value": [0.2, 0.4, 4.0, 0.9],
    }).to_arrow())


def test_effective_capacity_by_hand() -> None:
    con = duckdb.connect()
    out = effective_capacity(mrc=_curve(), physical_bytes=1000, bytes_per_token=2, scenario="s",
                             metric_samples=_metrics(con).filter("scenario = 's'"), reserved_bytes=100,
                             block_size_tokens=16)
    row = out.row(0, named=True)
    # active 0.3 x 1000; fragmentation 4 running x 8 tokens x 2 bytes; 1000-300-100-64 = 536
    assert (row["c_active_decode_bytes"], row["c_fragmentation_bytes"], row["c_eff_bytes"]) == (300, 64, 536)
    assert row["active_source"] == "kv_cache_usage_perc"
    assert row["hit_ratio_bytes_at_eff"] == 0.3  # curve read at 500 <= 536
    assert row["hit_ratio_bytes_at_2x_eff"] == 0.5  # 1000 <= 1072
    assert row["gain_from_2x_ratio"] == pytest.approx(0.2)


def test_effective_capacity_without_metrics_and_errors() -> None:
    out = effective_capacity(mrc=_curve(), physical_bytes=1100, bytes_per_token=2, scenario="s")
    row = out.row(0, named=True)
    assert (row["c_eff_bytes"], row["active_source"], row["hit_ratio_bytes_at_eff"]) == (1100, "none", 0.6)
    with pytest.raises(ConfigError):
        effective_capacity(mrc=_curve(), physical_bytes=0, bytes_per_token=2, scenario="s")
    with pytest.raises(NoDataError):
        effective_capacity(mrc=_curve(), physical_bytes=10, bytes_per_token=2, scenario="other")


def test_ttl_coverage_by_hand() -> None:
    # block 1 at 0 s, 10 s and 100 s; block 2 at 100 s; 1 token each, 1 byte per token.
    con = duckdb.connect()
    rb = con.from_arrow(pl.DataFrame({
        "request_id": ["a", "b", "c", "c"], "scenario": "s", "arrival_ns": [0, 10 * S, 100 * S, 100 * S],
        "position": [0, 0, 0, 1], "block_hash": pl.Series([1, 1, 1, 2], dtype=pl.UInt64), "block_tokens": 1,
        "block_size_tokens": 1,
    }).to_arrow())
    out = ttl_coverage(request_blocks=rb, bytes_per_token=1, scenario="s", ttls_s=[100, 30])
    assert out["ttl_s"].to_list() == [30.0, 100.0]
    short, long_ = out.row(0, named=True), out.row(1, named=True)
    assert (short["reaccesses"], short["covered_reaccesses"], long_["covered_reaccesses"]) == (2, 1, 2)
    # TTL 30 s: block 1 held 0..10 s then 10..40 s -> 40 byte-seconds over 100 s
    assert short["pinned_mean_bytes"] == pytest.approx(0.4, rel=1e-6)
    # TTL 100 s: held 0..100 s without a gap
    assert long_["pinned_mean_bytes"] == pytest.approx(1.0, rel=1e-6)
    assert long_["pinned_peak_bytes"] == 2.0  # at 100 s both blocks are resident
    assert short["ttl_hit_ratio_bytes"] == 0.25 and long_["ttl_hit_ratio_bytes"] == 0.5
    # with 2 bytes an LRU keeps block 1 through both re-accesses (distances 1 and 1)
    assert long_["lru_hit_ratio_bytes_at_peak"] == 0.5


def test_ttl_pinned_bytes_with_real_kv_bytes_do_not_overflow() -> None:
    # Llama-3.1-70B: 327,680 B per token, 512-token blocks (167,772,160 B each). One block held
    # for 60 s is 1.0e19 byte-nanoseconds, past int64 (9.2e18): the mean must stay exact.
    con = duckdb.connect()
    per_token, block = 327_680, 512
    rb = con.from_arrow(pl.DataFrame({
        "request_id": ["a", "b", "c"], "scenario": "s", "arrival_ns": [0, 100 * S, 200 * S],
        "position": [0, 0, 0], "block_hash": pl.Series([1, 2, 3], dtype=pl.UInt64), "block_tokens": block,
        "block_size_tokens": block,
    }).to_arrow())
    out = ttl_coverage(request_blocks=rb, bytes_per_token=per_token, scenario="s", ttls_s=[60])
    row = out.row(0, named=True)
    block_bytes = block * per_token
    # the window ends at the last access (200 s): blocks 1 and 2 are held 60 s each, block 3 1 ns
    assert row["pinned_mean_bytes"] == pytest.approx(2 * block_bytes * 60 / 200, rel=1e-9)
    assert row["pinned_peak_bytes"] == block_bytes


def test_analyze_writes_ttl_coverage_and_capacity_when_told_the_cache(
        tmp_path: Path, mooncake3: Path) -> None:
    from click.testing import CliRunner

    from kvlens.cli import cli
    from kvlens.collector.importer import import_files
    from kvlens.models import get_model

    lake, db = tmp_path / "lake", tmp_path / "a.duckdb"
    import_files("mooncake", [mooncake3], lake, scenario="s", model="llama-3.1-8b")
    per_token = get_model("llama-3.1-8b").kv_bytes_per_token()
    runner = CliRunner()
    assert runner.invoke(cli, ["analyze", "--lake", str(lake), "--db", str(db)]).exit_code == 0
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT count(*) FROM capacity").fetchall() == [(0,)]  # no cache size given
    assert con.execute("SELECT count(*) > 0 FROM ttl_coverage WHERE scenario = 's'").fetchall() == [(True,)]
    con.close()
    result = runner.invoke(cli, ["analyze", "--lake", str(lake), "--db", str(db), "--cache-tokens", "1024"])
    assert result.exit_code == 0, result.output
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute("SELECT c_physical_bytes, c_eff_bytes, active_source FROM capacity").fetchall()
    con.close()
    # No metric samples in this lake: nothing is subtracted, and the source says so.
    assert rows == [(1024 * per_token, 1024 * per_token, "none")]


@pytest.mark.parametrize("seed", range(5))
def test_pinned_peak_is_the_most_held_at_once(seed: int) -> None:
    """The pinned peak equals a brute-force count of the bytes held at each access's time (and the
    mean their byte-time over the span), on
    random streams with ties, zero-size blocks, zero TTLs and renewals at the same instant, in time
    order (stops merged from two sorted runs) and out of it (stops sorted)."""
    import numpy as np

    from kvlens.analyzers.capacity import _residences

    rng = np.random.default_rng(seed)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        ts = np.sort(rng.integers(0, 25, n)).astype(np.int64)
        keys = rng.integers(0, 4, n)
        nxt = np.full(n, -1, np.int64)
        last: dict[int, int] = {}
        for i in range(n - 1, -1, -1):
            nxt[i] = last.get(int(keys[i]), -1)
            last[int(keys[i])] = i
        sizes = rng.integers(0, 50, n).astype(np.int64)
        if rng.random() < 0.3:  # the accesses out of time order: the general path, not the merge
            perm = rng.permutation(n)
            back = np.argsort(perm)
            moved = np.where(nxt[perm] >= 0, back[np.maximum(nxt[perm], 0)], -1)
            ts, sizes, nxt = ts[perm], sizes[perm], moved
        ttl, end = int(rng.integers(0, 12)), int(rng.integers(0, 30))
        stop = np.where(nxt >= 0, np.minimum(ts + ttl, ts[np.maximum(nxt, 0)]), ts + ttl)
        stop = np.minimum(stop, max(end, int(ts.max()) + 1))
        # held just after the accesses at time t: begun at or before t and stopping after it (held
        # bytes only grow at an access, so the peak is at one of their times)
        expected = max(sum(int(s) for t0, t1, s in zip(ts, stop, sizes, strict=True) if t0 <= t < t1)
                       for t in ts.tolist())
        ((mean, peak),) = _residences(ts, nxt, sizes, [ttl], end)
        assert peak == expected
        span = max(1, int(stop.max()) - int(ts.min()))
        held = sum(int(s) * int(t1 - t0) for t0, t1, s in zip(ts, stop, sizes, strict=True))
        assert mean == pytest.approx(held / span, rel=1e-12, abs=1e-12)
        # several TTLs in one call (the kernel shares its work arrays between them) give each one's
        ttls = [int(t) for t in rng.integers(0, 12, 3)]
        one_each = [_residences(ts, nxt, sizes, [t], end)[0] for t in ttls]
        assert _residences(ts, nxt, sizes, ttls, end) == one_each


@pytest.mark.parametrize("seed", range(3))
def test_the_lru_hit_ratio_at_the_peak_is_the_exact_curves(seed: int) -> None:
    """lru_hit_ratio_bytes_at_peak is the byte hit ratio of the exact miss-ratio curve (mrc.py's
    ``curve``, another computation over the same distances) at a capacity of pinned_peak_bytes, on
    random streams of blocks of several sizes, with ties of distance and capacity."""
    import numpy as np

    from kvlens.analyzers.mrc import curve, exact_histogram
    from kvlens.analyzers.reuse import access_stream

    rng = np.random.default_rng(seed)
    con = duckdb.connect()
    for _ in range(40):
        n = int(rng.integers(1, 60))
        keys = rng.integers(1, 8, n)
        rb = con.from_arrow(pl.DataFrame({
            "request_id": [f"r{i}" for i in range(n)], "scenario": "s",
            "arrival_ns": rng.integers(0, 40, n) * S, "position": 0,
            "block_hash": pl.Series(keys, dtype=pl.UInt64),
            "block_tokens": pl.Series((keys % 3) + 1, dtype=pl.Int32),  # a size per block
            "block_size_tokens": pl.Series([None] * n, dtype=pl.Int32),
        }).to_arrow())
        out = ttl_coverage(request_blocks=rb, bytes_per_token=3, scenario="s", ttls_s=[0, 1, 5, 30])
        acc = access_stream(rb, "s", 3)
        hist = exact_histogram(acc.frame["block_hash"].to_numpy(), acc.sizes)
        for row in out.iter_rows(named=True):
            _, want = curve(hist, [row["pinned_peak_bytes"]], by="bytes")
            assert row["lru_hit_ratio_bytes_at_peak"] == pytest.approx(float(want[0]), abs=1e-12)
