"""The `requests` stream continued from its stack and summary (analyzers/stream_summary.py): reuse,
mrc and ttl_coverage of a growing lake equal those of the whole lake, row for row."""

from __future__ import annotations

import dataclasses
import importlib

import duckdb
import numba
import numpy as np
import polars as pl
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens.analyzers.capacity import ttl_coverage
from kvlens.analyzers.mrc import mrc
from kvlens.analyzers.reuse import ReuseState, access_stream, reuse, reuse_continued
from kvlens.analyzers.stream_summary import _add, exact_sum, requests_curves
from kvlens.schema import REUSE

_ORDER = list(REUSE.names)
_RATE = 0.5  # the SHARDS sample: about half the keys, so a short stream samples some
_TTLS = (0.000_000_010, 0.000_000_030, 1.0)  # 10 ns, 30 ns, 1 s: the streams below span 0-80 ns


def _lake(requests: list[tuple[int, str, list[int], int]]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """request_blocks and requests of scenario ``s``: (arrival, replica, chain, block size)."""
    rb, req = [], []
    for i, (arrival, replica, chain, size) in enumerate(requests):
        req.append({"request_id": f"r{i}", "scenario": "s", "replica": replica, "arrival_ns": arrival})
        for pos, block in enumerate(chain):
            rb.append({"request_id": f"r{i}", "scenario": "s", "arrival_ns": arrival, "position": pos,
                       "block_hash": block, "block_tokens": size, "block_size_tokens": size})
    return pl.DataFrame(rb, schema_overrides={"block_hash": pl.UInt64}), pl.DataFrame(req)


def _grown(frames: tuple[pl.DataFrame, pl.DataFrame], ends: list[int], lag: int,
           ) -> list[tuple[tuple[pl.DataFrame, ...], tuple[pl.DataFrame, ...], bool]]:
    """For each lake end: (reuse, mrc, ttl_coverage) continued from the previous run's state as
    ``kvlens analyze`` continues them, the same of the whole lake, and whether the run read the
    stream from the state's stack."""
    rb, req = frames
    con = duckdb.connect()
    reqs = con.from_arrow(req.to_arrow())
    out, table, state = [], None, None
    for end in ends:
        blocks = con.from_arrow(rb.filter(pl.col("arrival_ns") < end).to_arrow())
        if not blocks.aggregate("count(*)").fetchall()[0][0]:
            continue
        acc = access_stream(blocks, "s", 2, reqs, prior=state)
        got = reuse_continued(kv_events=None, bytes_per_token=2, scenario="s", stream=acc, resume=state,
                              checkpoint_ns=end - lag, earlier=table,
                              whole=lambda blocks=blocks: access_stream(blocks, "s", 2, reqs))
        assert got.refused is None, got.refused
        stream = got.stream or acc
        curves = requests_curves(stream, rate=_RATE, ttls_s=_TTLS, cut_ns=end - lag)
        table = (pl.concat([table.filter(pl.col("ts_ns") < got.since), got.frame]) if got.since is not None
                 else got.frame)
        kw = {"request_blocks": blocks, "bytes_per_token": 2, "scenario": "s"}
        mine = (table, mrc(**kw, sample_rate=_RATE, stream=stream, curves=curves),
                ttl_coverage(**kw, ttls_s=_TTLS, stream=stream, curves=curves))
        whole = (reuse(**kw, requests=reqs), mrc(**kw, sample_rate=_RATE), ttl_coverage(**kw, ttls_s=_TTLS))
        out.append((mine, whole, acc.stack is not None))
        assert got.state is not None
        saved = got.state.with_requests(curves.stack if curves else None, curves.summary if curves else None)
        state = ReuseState.from_bytes(saved.to_bytes())  # as the analysis DB keeps it
        kept = table.filter(pl.col("ts_ns") < state.checkpoint_ns).height
        state = dataclasses.replace(state, kept_rows=kept)
    return out


@settings(max_examples=120, deadline=None)
@given(requests=st.lists(st.tuples(st.integers(0, 80), st.sampled_from("ab"),
                                   st.lists(st.integers(1, 12), min_size=1, max_size=5),
                                   st.sampled_from([16, 16, 16, 32])), min_size=1, max_size=30),
       ends=st.lists(st.integers(1, 81), min_size=1, max_size=5, unique=True), lag=st.integers(0, 8),
       one_size=st.booleans())
def test_continued_curves_equal_those_of_the_whole_lake(
        requests: list[tuple[int, str, list[int], int]], ends: list[int], lag: int, one_size: bool) -> None:
    """A lake grown by random time slices, each run continuing from the state the previous one
    saved: reuse (every stream, groups included), the exact and SHARDS curves and every TTL row
    equal the whole lake's, exactly. With every block of one size the runs after the first read
    only the new accesses (from the state's stack); once a second size is in the lake they read the
    stream whole."""
    if one_size:
        requests = [(t, rep, chain, 16) for t, rep, chain, _ in requests]
    runs = _grown(_lake(requests), [*sorted(ends), 10**6], lag)
    for (table, curve, ttl), (whole, whole_curve, whole_ttl), _ in runs:
        assert table.sort(_ORDER).equals(whole.sort(_ORDER))
        assert curve.equals(whole_curve)
        assert ttl.equals(whole_ttl)
    if one_size:
        assert all(continued for _, _, continued in runs[1:])
    elif len({size for *_, size in requests}) > 1:
        assert not runs[-1][2]  # (the run that sees the second size reads the whole stream)


def test_a_new_root_takes_its_earlier_rows_from_the_table() -> None:
    """Block 2 is re-accessed at 200, and only at 300 starts a chain: the run continued from the
    stack (which holds no history of block 2 but its last access) finds its group rows before the
    checkpoint in the table the previous run wrote."""
    runs = _grown(_lake([(100, "a", [1, 2], 16), (200, "a", [1, 2], 16), (300, "b", [2, 5], 16)]),
                  [260, 10**6], lag=10)
    (first, _, _), (mine, whole, continued) = runs
    assert continued and "group:2" not in first[0]["stream"].to_list()
    assert mine[0].filter(pl.col("stream") == "group:2")["ts_ns"].to_list() == [200, 300]
    assert mine[0].sort(_ORDER).equals(whole[0].sort(_ORDER))


def test_the_counted_curves_equal_the_per_record_ones() -> None:
    """On a stream of one size, the curves summed from counts per distance equal those of a record
    per re-access (the same integer sums), and the TTL table the per-record code's (the mean within
    the rounding of its float sum)."""
    from kvlens.analyzers.capacity import _residences

    rng = np.random.default_rng(7)
    n = 3000
    chains = [[int(k) for k in rng.integers(1, 200, rng.integers(1, 6))] for _ in range(n // 3)]
    rb, _ = _lake([(int(t), "ab"[i % 2], chain, 16)
                     for i, (t, chain) in enumerate(zip(np.sort(rng.integers(0, 10**9, len(chains))), chains,
                                                        strict=True))])
    con = duckdb.connect()
    blocks = con.from_arrow(rb.to_arrow())
    acc = access_stream(blocks, "s", 3)
    curves = requests_curves(acc, rate=0.25, ttls_s=(0.01, 0.1, 1.0))
    assert curves is not None
    kw = {"request_blocks": blocks, "bytes_per_token": 3, "scenario": "s"}
    counted = mrc(**kw, sample_rate=0.25, stream=acc, curves=curves)
    mrc_module = importlib.import_module("kvlens.analyzers.mrc")  # (the package's `mrc` is the function)
    per_record = mrc_module._rows(mrc_module._histogram(acc.distances, acc.sizes), "exact", 48)
    exact = counted.filter(pl.col("method") == "exact")
    assert exact["hit_ratio_blocks"].to_list() == per_record["hit_ratio_blocks"].to_list()
    assert exact["hit_ratio_bytes"].to_list() == per_record["hit_ratio_bytes"].to_list()
    shards = mrc_module.shards_histogram(acc.frame["block_hash"].to_numpy(), acc.sizes, rate=0.25)
    hr, _ = mrc_module.curve(shards, exact["capacity_blocks"].to_numpy(), by="blocks")
    mine = counted.filter(pl.col("method") == "shards")
    hr_mine, _ = mrc_module.curve(mrc_module.counted_shards(curves.sampled, curves.size, curves.accesses,
                                                            curves.sampled_accesses, 0.25),
                                  exact["capacity_blocks"].to_numpy(), by="blocks")
    assert mine.height and np.allclose(hr, hr_mine, rtol=0, atol=1e-12)
    ts = acc.frame["ts_ns"].to_numpy()
    d = acc.distances
    nxt = np.full(len(ts), -1, np.int64)
    nxt[d.prev[d.reaccess]] = np.flatnonzero(d.reaccess)
    old = _residences(ts, nxt, acc.sizes, [10**7, 10**8, 10**9], int(ts.max()))
    for row, (mean, peak) in zip(curves.ttl, old, strict=True):
        assert row.peak == peak
        assert abs(row.held / row.span_ns - mean) <= 1e-9 * mean


@numba.njit(cache=False)
def _summed(values: np.ndarray) -> tuple[np.uint64, np.uint64]:
    hi, lo = np.uint64(0), np.uint64(0)
    for i in range(values.shape[0]):
        hi, lo = _add(hi, lo, values[i])
    return hi, lo


@given(values=st.lists(st.integers(0, 2**64 - 1), max_size=40))
def test_the_128_bit_sum_is_exact(values: list[int]) -> None:
    hi, lo = _summed(np.array(values, np.uint64))
    assert exact_sum(hi, lo) == sum(values)


def test_byte_nanoseconds_past_int64_are_summed_exactly() -> None:
    """Two accesses of 1 GB blocks held an hour: 7.2e21 byte-ns, past int64 (and past a float's
    integers): the mean is the exact integer over the span."""
    hour = 3600 * 10**9
    rb, _ = _lake([(0, "a", [1], 16), (hour, "a", [2], 16)])
    con = duckdb.connect()
    acc = access_stream(con.from_arrow(rb.to_arrow()), "s", 2**30 // 16)
    curves = requests_curves(acc, rate=None, ttls_s=(7200.0,))
    assert curves is not None
    (row,) = curves.ttl
    # the first block held until the end (the last access + 1 ns), the second 1 ns
    assert row.held == 2**30 * (hour + 1) + 2**30 * 1
    assert row.span_ns == hour + 1
