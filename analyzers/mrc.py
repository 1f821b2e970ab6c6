"""Analyzer: request_blocks -> LRU miss-ratio curves, exact and SHARDS-sampled (table `mrc`).

The cache is paged KV memory: the stream is the scenario's full blocks (``request_stream``) and
a capacity is a number of block slots; the table's curve is read by blocks.

A curve comes from a **reuse histogram**: one record per re-access with its stack distance (in
blocks and bytes, convention of analyzers.reuse: the block itself counts, so an LRU of capacity
``C`` hits exactly the records with distance ``<= C``) and the weight it stands for (1 for an
exact record, ``1/R`` for a record sampled at rate ``R``), plus the stream's totals. Histograms
**merge** by summing records and totals, so curves computed per hash partition (each partition
a spatial sample of rate 1/K) combine into one fleet curve, as SHARDS allows.

- Exact: every access, distances from the O(N log M) kernel.
- SHARDS fixed-rate (Waldspurger et al., FAST'15): a key is sampled when ``mix64(key ^ seed) <
  R·2^64``; distances on the sampled stream are scaled back (``(d−1)/R + 1`` blocks, the block
  itself kept at its size); SHARDS_adj adds ``N − N_sampled/R`` references (and the bytes
  likewise) at the smallest distance, correcting the sampled total to the true total.
- SHARDS fixed-size: at most ``max_keys`` keys are tracked; when a new key overflows the set, the
  key with the largest hash leaves and the threshold drops to its hash. Each record carries the
  ``1/R`` in force when it was seen (the paper's rescaling of older counts), and adj uses that sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numba
import numpy as np
import polars as pl

from kvlens.analyzers.partitions import Counted, Partitions, Runner, in_process, split_by_partition
from kvlens.analyzers.reuse import (
    _SIZE,
    _SLOT,
    CHUNK_ROWS,
    AccessStream,
    Distances,
    _factorize,
    _fw_prefix,
    _stack_push,
    _stack_take,
    access_stream,
    key_hashes,
    reuse_distances,
)
from kvlens.analyzers.stream_summary import (
    Curves,
    CurvesChain,
    curves_out_of_core,
    requests_curves,
    sample_threshold,
)
from kvlens.schema import MRC

__all__ = [
    "ReuseHistogram",
    "curve",
    "exact_histogram",
    "merge",
    "mrc",
    "mrc_out_of_core",
    "partition_histogram",
    "partition_histograms",
    "shards_histogram",
]

_TWO64 = 2.0**64
GRID_POINTS = 200
ALL_POINTS_UP_TO = 2000


@dataclass(frozen=True)
class ReuseHistogram:
    """Re-access records (distances, weights) and the stream totals they are a part of."""

    distance_blocks: np.ndarray  # float64
    distance_bytes: np.ndarray  # float64
    weight: np.ndarray  # float64: references each record stands for
    weight_bytes: np.ndarray  # float64: bytes each record stands for
    total_accesses: float
    total_bytes: float


def merge(*hists: ReuseHistogram) -> ReuseHistogram:
    """One histogram from several (hash partitions, days, replicas' samples): records and totals add."""
    def cat(field: str) -> np.ndarray:
        return np.concatenate([getattr(h, field) for h in hists])

    return ReuseHistogram(cat("distance_blocks"), cat("distance_bytes"), cat("weight"), cat("weight_bytes"),
                          float(sum(h.total_accesses for h in hists)),
                          float(sum(h.total_bytes for h in hists)))


def _as_arrays(keys: np.ndarray, sizes: np.ndarray | int) -> tuple[np.ndarray, np.ndarray]:
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    sizes_arr = (np.full(keys.shape[0], sizes, np.int64) if np.isscalar(sizes)
                 else np.ascontiguousarray(sizes, dtype=np.int64))
    return keys, sizes_arr


def exact_histogram(keys: np.ndarray, sizes: np.ndarray | int = 1) -> ReuseHistogram:
    """The exact histogram: every re-access, weight 1."""
    keys, sizes_arr = _as_arrays(keys, sizes)
    return _histogram(reuse_distances(keys, sizes_arr), sizes_arr)


def _histogram(d: Distances, sizes_arr: np.ndarray) -> ReuseHistogram:
    r = d.reaccess
    return ReuseHistogram(d.blocks[r].astype(np.float64), d.bytes[r].astype(np.float64),
                          np.ones(int(r.sum())), sizes_arr[r].astype(np.float64),
                          float(sizes_arr.shape[0]), float(sizes_arr.sum()))


def _scaled(d: ReuseHistogram, rate: float) -> tuple[np.ndarray, np.ndarray]:
    size = d.weight_bytes  # exact records: weight_bytes is the access's own size
    return (d.distance_blocks - 1.0) / rate + 1.0, (d.distance_bytes - size) / rate + size


def _adjusted(blocks: np.ndarray, byts: np.ndarray, w: np.ndarray, wb: np.ndarray,
              n: float, total_bytes: float, sampled_w: float, sampled_wb: float,
              adjust: bool) -> ReuseHistogram:
    if adjust:  # SHARDS_adj: the missing (or surplus) references join the first bucket
        blocks, byts = np.append(blocks, 1.0), np.append(byts, 0.0)
        w, wb = np.append(w, n - sampled_w), np.append(wb, total_bytes - sampled_wb)
    return ReuseHistogram(blocks, byts, w, wb, n, total_bytes)


def shards_histogram(keys: np.ndarray, sizes: np.ndarray | int = 1, *, rate: float | None = None,
                     max_keys: int | None = None, adjust: bool = True, seed: int = 0) -> ReuseHistogram:
    """SHARDS estimate: fixed-rate (``rate``) or fixed-size (``max_keys``), with SHARDS_adj by default."""
    if (rate is None) == (max_keys is None):
        raise ValueError("give exactly one of rate (fixed-rate) or max_keys (fixed-size)")
    keys, sizes_arr = _as_arrays(keys, sizes)
    hashes = key_hashes(keys, np.uint64(seed))
    n, total_bytes = float(keys.shape[0]), float(sizes_arr.sum())
    if rate is not None:
        below = sample_threshold(rate)
        picked = hashes < below if below is not None else slice(None)
        h = exact_histogram(keys[picked], sizes_arr[picked])
        blocks, byts = _scaled(h, rate)
        return _adjusted(blocks, byts, h.weight / rate, h.weight_bytes / rate, n, total_bytes,
                         h.total_accesses / rate, h.total_bytes / rate, adjust)
    if max_keys is None or max_keys < 1:
        raise ValueError(f"max_keys must be at least 1, got {max_keys}")
    ids, m = _factorize(keys)
    key_hash = np.empty(m, np.uint64)
    key_hash[ids] = hashes
    rec = np.empty((keys.shape[0], 4), np.float64)
    t = max(2 * (max_keys + 1), 64)
    count, sw, swb = _fixed_size_kernel(ids, sizes_arr, key_hash, max_keys, rec, np.zeros((t, 2), np.int64),
                                        np.full(t, -1, np.int64), np.zeros((m, 4), np.int64))
    r = rec[:count]
    return _adjusted(r[:, 0].copy(), r[:, 1].copy(), r[:, 2].copy(), r[:, 3].copy(),
                     n, total_bytes, sw, swb, adjust)


def counted_histogram(counts: np.ndarray, size: int, accesses: int) -> ReuseHistogram:
    """The exact histogram of a stream of ``accesses`` accesses of ``size`` bytes each, whose
    re-accesses are ``counts[d]`` at each distance d in blocks: one record per distance, weighing
    its count (a curve sums the weights: the same sums as a record per re-access)."""
    at = np.flatnonzero(counts)
    n = counts[at]
    return ReuseHistogram(at.astype(np.float64), (at * size).astype(np.float64), n.astype(np.float64),
                          (n * size).astype(np.float64), float(accesses), float(accesses * size))


def counted_shards(counts: np.ndarray, size: int, accesses: int, sampled_accesses: int,
                   rate: float) -> ReuseHistogram:
    """SHARDS fixed-rate with adj (``shards_histogram``) from the sample's re-accesses per
    distance (``counts``, distances within the sample) and its accesses, in a stream of
    ``accesses`` accesses of ``size`` bytes each."""
    at = np.flatnonzero(counts)
    n = counts[at].astype(np.float64)
    d = at.astype(np.float64)
    return _adjusted((d - 1.0) / rate + 1.0, (d * size - size) / rate + size, n / rate, n * size / rate,
                     float(accesses), float(accesses * size), sampled_accesses / rate,
                     sampled_accesses * size / rate, True)


@numba.njit(cache=True)
def _heap_push(hh: np.ndarray, hk: np.ndarray, size: int, h: np.uint64, k: int) -> None:
    j = size
    while j > 0:
        parent = (j - 1) >> 1
        if hh[parent] >= h:
            break
        hh[j], hk[j] = hh[parent], hk[parent]
        j = parent
    hh[j], hk[j] = h, k


@numba.njit(cache=True)
def _heap_pop(hh: np.ndarray, hk: np.ndarray, size: int) -> None:
    """Removes the root of a max-heap of ``size`` entries."""
    last_h, last_k = hh[size - 1], hk[size - 1]
    n = size - 1
    j = 0
    while True:
        c = 2 * j + 1
        if c >= n:
            break
        if c + 1 < n and hh[c + 1] > hh[c]:
            c += 1
        if hh[c] <= last_h:
            break
        hh[j], hk[j] = hh[c], hk[c]
        j = c
    if n > 0:
        hh[j], hk[j] = last_h, last_k


@numba.njit(cache=True)
def _fixed_size_kernel(ids: np.ndarray, sizes: np.ndarray, key_hash: np.ndarray, max_keys: int,
                       rec: np.ndarray, tree: np.ndarray, slot_key: np.ndarray, state: np.ndarray
                       ) -> tuple[int, float, float]:
    state[:, _SLOT] = -1
    in_sample = np.zeros(key_hash.shape[0], np.bool_)
    hh = np.empty(max_keys + 1, np.uint64)
    hk = np.empty(max_keys + 1, np.int64)
    heap_n = 0
    threshold = np.uint64(0xFFFFFFFFFFFFFFFF)
    rate = 1.0
    live_c = 0
    live_b = 0
    nxt = 0
    count = 0
    sampled_w = 0.0
    sampled_wb = 0.0
    for i in range(ids.shape[0]):
        k = ids[i]
        if key_hash[k] >= threshold:
            continue
        if not in_sample[k]:
            _heap_push(hh, hk, heap_n, key_hash[k], k)
            heap_n += 1
            in_sample[k] = True
            if heap_n > max_keys:
                out_k = hk[0]
                threshold = hh[0]
                rate = threshold / _TWO64
                _heap_pop(hh, hk, heap_n)
                heap_n -= 1
                in_sample[out_k] = False
                p_out = state[out_k, _SLOT]
                if p_out >= 0:
                    _stack_take(tree, slot_key, p_out, state[out_k, _SIZE])
                    live_c -= 1
                    live_b -= state[out_k, _SIZE]
                    state[out_k, _SLOT] = -1
                if out_k == k:
                    continue
        s = sizes[i]
        sampled_w += 1.0 / rate
        sampled_wb += s / rate
        p = state[k, _SLOT]
        if p >= 0:
            old = state[k, _SIZE]
            c, b = _fw_prefix(tree, p)
            rec[count, 0] = (live_c - c) / rate + 1.0
            rec[count, 1] = (live_b - b) / rate + old
            rec[count, 2] = 1.0 / rate
            rec[count, 3] = s / rate
            count += 1
            _stack_take(tree, slot_key, p, old)
            live_c -= 1
            live_b -= old
        nxt = _stack_push(tree, slot_key, state, k, s, nxt)
        live_c += 1
        live_b += s
    return count, sampled_w, sampled_wb


def partition_histograms(keys: np.ndarray, sizes: np.ndarray | int = 1, *, partitions: int,
                         seed: int = 0, run: Runner = in_process) -> list[ReuseHistogram]:
    """One exact histogram per hash partition ``mix64(key ^ seed) % K``, scaled as a rate-1/K sample.

    This is what a worker holding one partition computes (``run`` maps ``partition_histogram``
    over the partitions: in this process, or as Ray tasks, analyzers/ray_runner.py); ``merge`` of
    all K gives the fleet curve (exact when K = 1; otherwise the mean of K SHARDS estimates,
    without adj, whose surpluses cancel across partitions).
    """
    keys, sizes_arr = _as_arrays(keys, sizes)
    part = key_hashes(keys, np.uint64(seed)) % np.uint64(partitions)
    chosen = ((keys[rows], sizes_arr[rows], partitions)
              for rows in split_by_partition(part.astype(np.int64), partitions))
    return list(run(partition_histogram, Counted(chosen, partitions)))


def partition_histogram(keys: np.ndarray, sizes: np.ndarray, partitions: int) -> ReuseHistogram:
    """One hash partition's exact histogram (its keys' accesses, in stream order), scaled as a
    rate-1/``partitions`` spatial sample."""
    h = exact_histogram(keys, sizes)
    blocks, byts = _scaled(h, 1.0 / partitions)
    return ReuseHistogram(blocks, byts, h.weight * partitions, h.weight_bytes * partitions,
                          h.total_accesses * partitions, h.total_bytes * partitions)


def curve(hist: ReuseHistogram, capacities: Sequence[float] | np.ndarray, *,
          by: str = "bytes") -> tuple[np.ndarray, np.ndarray]:
    """(hit_ratio_blocks, hit_ratio_bytes) of an LRU cache at each capacity.

    ``by="bytes"``: capacities in bytes, each block costs its bytes (distance_bytes <= C).
    ``by="blocks"``: capacities in blocks, each block costs one slot (distance_blocks <= C).
    Ratios are clipped to [0, 1] (SHARDS_adj can push a sampled curve just past either end).
    Exact for an LRU when each block keeps one size and capacities are at least the largest
    block; when a block's size changes, it is the stack model's reading (a real LRU that evicted
    for a block's larger size does not refill when it shrinks).
    """
    dist = hist.distance_bytes if by == "bytes" else hist.distance_blocks
    if by not in ("bytes", "blocks"):
        raise ValueError(f"by must be 'bytes' or 'blocks', got {by!r}")
    caps = np.asarray(capacities, np.float64)
    whole = len(dist) > 0 and dist.min() >= 0 and dist.max() <= 4 * len(dist) + 1024
    if whole and np.array_equal(dist, np.floor(dist)):
        # Whole-number distances (exact blocks; bytes in small units): an O(N) histogram, no sort.
        n_bins = int(dist.max()) + 1
        cw = np.concatenate([[0.0], np.cumsum(np.bincount(dist.astype(np.int64), hist.weight, n_bins))])
        bins = dist.astype(np.int64)
        cwb = np.concatenate([[0.0], np.cumsum(np.bincount(bins, hist.weight_bytes, n_bins))])
        at = np.clip(np.floor(caps), -1, n_bins - 1).astype(np.int64) + 1
    else:
        order = np.argsort(dist, kind="stable")
        cw = np.concatenate([[0.0], np.cumsum(hist.weight[order])])
        cwb = np.concatenate([[0.0], np.cumsum(hist.weight_bytes[order])])
        at = np.searchsorted(dist[order], caps, side="right")
    hr = cw[at] / hist.total_accesses if hist.total_accesses else np.zeros(len(at))
    hrb = cwb[at] / hist.total_bytes if hist.total_bytes else np.zeros(len(at))
    return np.clip(hr, 0.0, 1.0), np.clip(hrb, 0.0, 1.0)


def _grid_blocks(max_blocks: int) -> np.ndarray:
    """Every capacity up to ALL_POINTS_UP_TO blocks, else a log grid ending where the curve flattens."""
    if max_blocks <= ALL_POINTS_UP_TO:
        return np.arange(1, max_blocks + 1, dtype=np.int64)
    grid = np.unique(np.round(np.geomspace(1, max_blocks, GRID_POINTS)).astype(np.int64))
    return np.union1d(grid, [max_blocks])


def _rows(hist: ReuseHistogram, method: str, block_bytes: int) -> pl.DataFrame:
    top = float(hist.distance_blocks.max()) if len(hist.distance_blocks) else 0.0
    cap_blocks = _grid_blocks(max(1, int(np.ceil(top))))
    hr, hrb = curve(hist, cap_blocks, by="blocks")
    return pl.DataFrame({"method": method, "capacity_blocks": cap_blocks,
                         "capacity_bytes": cap_blocks * block_bytes, "hit_ratio_blocks": hr,
                         "hit_ratio_bytes": hrb})


def mrc(*, request_blocks: duckdb.DuckDBPyRelation, bytes_per_token: int, scenario: str,
        sample_rate: float | None = None, stream: AccessStream | None = None,
        partitions: Partitions | None = None, curves: Curves | None = None) -> pl.DataFrame:
    """Rows of table `mrc` for the `requests` stream, sorted by method, capacity_bytes.

    Columns: scenario, stream, method (exact | shards), capacity_blocks, capacity_bytes,
    hit_ratio_blocks, hit_ratio_bytes. The stream is the prefix-cache stream of
    ``analyzers.reuse.request_stream``: the scenario's **full** blocks in arrival order, then
    position (a partial tail is never cached by an engine, so it is never in a curve). Each row
    is an LRU cache of ``capacity_blocks`` slots, a slot holding one block as paged KV memory
    does; ``capacity_bytes = capacity_blocks × full-block bytes`` (block_size_tokens ×
    bytes_per_token). hit_ratio_blocks counts hit accesses over accesses, hit_ratio_bytes hit
    bytes over accessed bytes (the same ratio when every full block has one size): both over
    the full blocks, not over prompt tokens (``prompt − tail_partial`` tokens of request_ledger
    converts). The exact rows equal such an LRU at every capacity they report.
    Capacities: every whole number of blocks up to the one where every re-access hits, when
    that is at most 2,000 blocks; otherwise a 200-point log grid plus that saturation point.
    Each value is exact at its capacity (the curve is a step function between them).
    ``sample_rate`` adds SHARDS_adj fixed-rate rows (method shards) on the same kind of grid.
    ``stream``: the scenario's access stream when the caller already built it; ``curves``: its
    figures (analyzers/stream_summary.py), when the caller has them, for ``sample_rate``. When every
    access has one size the curves are summed from counts per distance (the same sums), which a
    stream continued from a saved state keeps (``partitions`` needs the whole stream). ``partitions``
    (K of them) adds rows of method ``partitioned``: the curve merged from K block-hash
    partitions, each an exact histogram of its keys scaled as a rate-1/K sample
    (``partition_histograms``: what K workers compute without sharing memory; exactly the exact
    curve when K = 1), on the exact rows' grid.
    """
    acc = stream or access_stream(request_blocks, scenario, bytes_per_token)
    if curves is None and (partitions is None or acc.stack is None):
        curves = requests_curves(acc, rate=sample_rate, ttls_s=())
    rs, sizes = acc.frame, acc.sizes
    full = _block_size(request_blocks) or (curves.tokens if curves is not None
                                           else int(rs["block_tokens"].to_numpy().max()))
    block_bytes = max(1, full * bytes_per_token)
    if curves is not None:
        parts = _counted_parts(curves, sample_rate, block_bytes)
    else:
        parts = [_rows(_histogram(acc.distances, sizes), "exact", block_bytes)]
        if sample_rate is not None:
            parts.append(_rows(shards_histogram(rs["block_hash"].to_numpy(), sizes, rate=sample_rate),
                               "shards", block_bytes))
    if partitions is not None:
        if acc.stack is not None:
            raise ValueError("the partitioned curve needs the whole stream (access_stream without a state)")
        keys = rs["block_hash"].to_numpy()
        count = partitions.for_rows(len(keys))
        merged = merge(*partition_histograms(keys, sizes, partitions=count, run=partitions.run))
        grid = parts[0]["capacity_blocks"].to_numpy()
        hr, hrb = curve(merged, grid, by="blocks")
        parts.append(pl.DataFrame({"method": "partitioned", "capacity_blocks": grid,
                                   "capacity_bytes": grid * block_bytes, "hit_ratio_blocks": hr,
                                   "hit_ratio_bytes": hrb}))
    return _table(parts, scenario)


def _counted_parts(curves: Curves, sample_rate: float | None, block_bytes: int) -> list[pl.DataFrame]:
    """The exact rows (and the shards rows, with ``sample_rate``) from a stream's counts."""
    if curves.rate != sample_rate:
        raise ValueError(f"the curves were summed at sample rate {curves.rate}, not {sample_rate}")
    parts = [_rows(counted_histogram(curves.exact, curves.size, curves.accesses), "exact", block_bytes)]
    if sample_rate is not None and curves.sampled is not None:
        parts.append(_rows(counted_shards(curves.sampled, curves.size, curves.accesses,
                                          curves.sampled_accesses, sample_rate), "shards", block_bytes))
    return parts


def _table(parts: list[pl.DataFrame], scenario: str) -> pl.DataFrame:
    out = pl.concat(parts).with_columns(scenario=pl.lit(scenario), stream=pl.lit("requests"))
    return out.select(MRC.names).sort("method", "capacity_bytes")


def _block_size(request_blocks: duckdb.DuckDBPyRelation) -> int | None:
    rows = request_blocks.aggregate("mode(block_size_tokens) AS b").fetchall()
    return int(rows[0][0]) if rows and rows[0][0] else None


def mrc_out_of_core(con: duckdb.DuckDBPyConnection, scenario: str, *, work: Path, partitions: int,
                    bytes_per_token: int, sample_rate: float | None = None, chain: CurvesChain | None = None,
                    rows: int = CHUNK_ROWS) -> pl.DataFrame:
    """Table `mrc`'s rows of ``scenario`` (``mrc``'s without ``partitions``: exact, and shards with
    ``sample_rate``), read from the lake views on ``con`` (``kvlens analyze --out-of-core``).

    The `requests` stream is read in order in chunks of about ``rows`` accesses on one LRU stack
    (reuse.py ``requests_read``); its counts per distance, and its SHARDS sample's, are summed as
    ``mrc`` sums them (stream_summary.py ``CurvesChain``), and the rows are made by ``mrc``'s own
    code: they are its rows exactly. ``chain``: the stream's figures when the caller summed them
    in its own read (``reuse_out_of_core``'s ``on_chunk``: one read for reuse, mrc and
    ttl_coverage), at ``sample_rate``. In memory: a chunk, the stack (O(rows + distinct blocks)),
    the counts and the sample's keys (about ``sample_rate`` of the accesses). A stream of several
    block sizes is refused (ConfigError). ``work`` and ``partitions`` are not used."""
    del work, partitions
    curves = (chain.done(con, scenario) if chain is not None else
              curves_out_of_core(con, scenario, bytes_per_token=bytes_per_token, rate=sample_rate, ttls_s=(),
                                 rows=rows))
    blocks = con.table("request_blocks").filter(duckdb.ColumnExpression("scenario")
                                                == duckdb.ConstantExpression(scenario))
    block_bytes = max(1, (_block_size(blocks) or curves.tokens) * bytes_per_token)
    return _table(_counted_parts(curves, sample_rate, block_bytes), scenario)
