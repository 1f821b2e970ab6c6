"""Analyzer: configuration, metric_samples and the mrc curve -> effective capacity; reuse vs TTL.

Two questions an operator asks after reading a miss-ratio curve:

- ``effective_capacity``: how much of the KV pool actually holds reusable prefixes.
  ``C_eff = C_physical − C_active_decode − C_reserved − C_fragmentation`` where
  C_active_decode is what running requests pin (observed ``kv_cache_usage_perc`` × C_physical,
  vLLM's usage counting blocks held by running requests only; else running requests × mean
  context × bytes/token), C_reserved is configured, and C_fragmentation is the half block a
  running sequence wastes on average (``running × block_size/2 × bytes/token``) unless given.
  Placed on the exact `requests` curve: the hit ratio at C_eff and at 2·C_eff (read at the
  largest curve capacity not above it: a conservative step reading).
- ``ttl_coverage``: for each TTL, the re-accesses whose interval fits (they would hit a cache
  keeping each block TTL seconds after its last access), and what that TTL pins: mean and peak
  bytes resident, each access keeping its block ``min(TTL, time to its next access)``. The LRU
  hit ratio at the same peak bytes sits beside it: where LRU does better with the same bytes,
  a TTL is the wrong knob.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import duckdb
import numba
import numpy as np
import polars as pl

from kvlens.analyzers.reuse import CHUNK_ROWS, AccessStream, access_stream
from kvlens.analyzers.stream_summary import Curves, CurvesChain, TtlRow, curves_out_of_core, requests_curves
from kvlens.errors import ConfigError, NoDataError

__all__ = ["DEFAULT_TTLS_S", "effective_capacity", "ttl_coverage", "ttl_coverage_out_of_core"]

DEFAULT_TTLS_S = (1.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 14400.0, 86400.0)
_USAGE_METRICS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
_RUNNING_METRICS = ("vllm:num_requests_running", "sglang:num_running_reqs")
_NS_PER_S = 1_000_000_000


def _metric_mean(metric_samples: duckdb.DuckDBPyRelation | None, names: Sequence[str]) -> float | None:
    if metric_samples is None:
        return None
    for name in names:
        rel = metric_samples.filter(duckdb.ColumnExpression("name") == duckdb.ConstantExpression(name))
        rows = rel.aggregate("avg(value) AS v").fetchall()
        if rows and rows[0][0] is not None:
            return float(rows[0][0])
    return None


def _hit_at(curve: pl.DataFrame, capacity_bytes: float) -> float:
    below = curve.filter(pl.col("capacity_bytes") <= capacity_bytes)
    return float(below["hit_ratio_bytes"][-1]) if below.height else 0.0


def effective_capacity(*, mrc: pl.DataFrame, physical_bytes: int, bytes_per_token: int, scenario: str,
                       metric_samples: duckdb.DuckDBPyRelation | None = None, reserved_bytes: int = 0,
                       fragmentation_bytes: int | None = None, block_size_tokens: int = 16,
                       mean_context_tokens: float | None = None) -> pl.DataFrame:
    """One row: the capacity terms and where C_eff sits on the exact `requests` curve.

    Columns: scenario, c_physical_bytes, c_active_decode_bytes, c_reserved_bytes,
    c_fragmentation_bytes, c_eff_bytes, active_source (kv_cache_usage_perc | running_requests |
    none), hit_ratio_bytes_at_eff, hit_ratio_bytes_at_2x_eff, gain_from_2x_ratio.
    ``mrc`` is a frame of table `mrc` (rows of other scenarios, streams and methods are ignored);
    ``metric_samples``, when given, the scenario's rows.
    """
    if physical_bytes <= 0:
        raise ConfigError(f"physical capacity must be positive, got {physical_bytes} bytes")
    usage = _metric_mean(metric_samples, _USAGE_METRICS)
    running = _metric_mean(metric_samples, _RUNNING_METRICS) or 0.0
    if usage is not None:
        active, source = usage * physical_bytes, "kv_cache_usage_perc"
    elif running and mean_context_tokens:
        active, source = running * mean_context_tokens * bytes_per_token, "running_requests"
    else:
        active, source = 0.0, "none"
    frag = (running * block_size_tokens / 2 * bytes_per_token if fragmentation_bytes is None
            else fragmentation_bytes)
    c_eff = max(0.0, physical_bytes - active - reserved_bytes - frag)
    exact = mrc.filter((pl.col("scenario") == scenario) & (pl.col("stream") == "requests")
                       & (pl.col("method") == "exact")).sort("capacity_bytes")
    if exact.height == 0:
        raise NoDataError(f"no exact requests curve for scenario {scenario!r}: run the mrc analyzer first")
    at, at2 = _hit_at(exact, c_eff), _hit_at(exact, 2 * c_eff)
    return pl.DataFrame({
        "scenario": [scenario], "c_physical_bytes": [int(physical_bytes)],
        "c_active_decode_bytes": [int(active)], "c_reserved_bytes": [int(reserved_bytes)],
        "c_fragmentation_bytes": [int(frag)], "c_eff_bytes": [int(c_eff)], "active_source": [source],
        "hit_ratio_bytes_at_eff": [at], "hit_ratio_bytes_at_2x_eff": [at2], "gain_from_2x_ratio": [at2 - at],
    })


@numba.njit(cache=True)
def _in_order(ts: np.ndarray, nxt: np.ndarray, sizes: np.ndarray, ttls_ns: np.ndarray,
              cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean and peak bytes held under each TTL of ``ttls_ns``, ``ts`` in time order: one pass per
    TTL over the stream, no sort, the work arrays shared by the TTLs.

    Mean: the byte-nanoseconds held over the span from the first access to the last stop. Byte-
    nanoseconds overflow int64 with real KV sizes (a 512-token Llama-3.1-70B block held 60 s is
    1.0e19): they are summed in float64, compensated (Neumaier), so the sum is as exact as the
    products.

    Peak: the most bytes held just after an access. Held after access k: the bytes accessed up to
    it less those stopped at or before its time (stops first at a tie). A residency stops at its
    expiry (``ts + TTL``, capped) unless the next access renews it first; then at that access's
    time. Both kinds of stop come in time order (expiries in their accesses' order, renewals in
    the renewing accesses'), so two cursors walk them beside the accesses."""
    n, k = len(ts), len(ttls_ns)
    means, peaks = np.zeros(k, np.float64), np.zeros(k, np.int64)
    renewed = np.zeros(n, np.bool_)  # residency i ends at its renewal
    renewing = np.zeros(n, np.int64)  # bytes whose residency access j's renewal stops
    renews = np.zeros(n, np.bool_)
    for q in range(k):
        ttl_ns = ttls_ns[q]
        renews[:] = False
        total, comp, last_stop = 0.0, 0.0, -(2**62)
        for i in range(n):
            j = nxt[i]
            stop = ts[i] + ttl_ns
            renewed[i] = j >= 0 and ts[j] <= stop
            if renewed[i]:
                stop = ts[j]
                renews[j] = True
                renewing[j] = sizes[i]
            stop = min(stop, cap)
            last_stop = max(last_stop, stop)
            term = float(sizes[i]) * float(stop - ts[i])
            added = total + term
            comp += (total - added) + term if abs(total) >= abs(term) else (term - added) + total
            total = added
        means[q] = (total + comp) / max(1, last_stop - ts[0])  # (the caller gives n > 0)
        accessed, stopped, peak = 0, 0, -(2**62)
        e, r = 0, 0
        for a in range(n):
            t = ts[a]
            accessed += sizes[a]
            while e < n and (renewed[e] or min(ts[e] + ttl_ns, cap) <= t):
                if not renewed[e]:
                    stopped += sizes[e]
                e += 1
            while r < n and (not renews[r] or min(ts[r], cap) <= t):
                if renews[r]:
                    stopped += renewing[r]
                r += 1
            peak = max(peak, accessed - stopped)
        peaks[q] = peak
    return means, peaks


def _residences(ts: np.ndarray, nxt: np.ndarray, sizes: np.ndarray, ttls_ns: Sequence[int],
                end_ns: int) -> list[tuple[float, float]]:
    """Mean and peak bytes a TTL cache holds, per TTL of ``ttls_ns``; each access keeps its block
    until min(ts+TTL, next access, the end)."""
    if not len(ts):
        return [(0.0, 0.0) for _ in ttls_ns]
    cap = max(end_ns, int(ts.max()) + 1)
    if bool(np.all(ts[1:] >= ts[:-1])):  # a stream is in time order: one pass per TTL
        means, peaks = _in_order(ts, nxt, sizes.astype(np.int64), np.asarray(ttls_ns, np.int64), cap)
        return [(float(m), float(p)) for m, p in zip(means, peaks, strict=True)]
    out = []
    starts = np.argsort(ts, kind="stable")
    for ttl_ns in ttls_ns:
        stop = np.where(nxt >= 0, np.minimum(ts + ttl_ns, ts[np.maximum(nxt, 0)]), ts + ttl_ns)
        stop = np.minimum(stop, cap)
        span = max(1, int(stop.max()) - int(ts.min()))
        mean = math.fsum((sizes.astype(np.float64) * (stop - ts).astype(np.float64)).tolist()) / span
        # The peak is reached just after some access (held bytes only grow there): the bytes
        # accessed up to it less those stopped at or before its time (a stop first at a tie).
        ends = np.sort(stop)
        stop_sizes = np.concatenate([[0], np.cumsum(sizes[np.argsort(stop, kind="stable")])])
        held = np.cumsum(sizes[starts]) - stop_sizes[np.searchsorted(ends, ts[starts], side="right")]
        out.append((mean, float(held.max())))
    return out


def ttl_coverage(*, request_blocks: duckdb.DuckDBPyRelation, bytes_per_token: int, scenario: str,
                 ttls_s: Sequence[float] = DEFAULT_TTLS_S,
                 stream: AccessStream | None = None, curves: Curves | None = None) -> pl.DataFrame:
    """One row per TTL for the `requests` stream, sorted by ttl_s.

    Columns: scenario, ttl_s, reaccesses, covered_reaccesses, covered_ratio (of re-accesses),
    covered_bytes_ratio (of re-accessed bytes), pinned_mean_bytes, pinned_peak_bytes,
    lru_hit_ratio_bytes_at_peak (exact LRU byte hit ratio with pinned_peak_bytes of capacity),
    ttl_hit_ratio_bytes (covered re-access bytes over all accessed bytes, to compare with it).
    ``stream``: the scenario's access stream when the caller already built it; ``curves``: its
    figures (analyzers/stream_summary.py) for ``ttls_s``, when the caller has them. When every
    access has one size they come from the stream's stack and counts (what a stream continued from
    a saved state keeps): byte-nanoseconds summed exactly as integers.
    """
    acc = stream or access_stream(request_blocks, scenario, bytes_per_token)
    if curves is None:
        curves = requests_curves(acc, rate=None, ttls_s=tuple(ttls_s))
    if curves is not None:
        return _counted_rows(curves, scenario, sorted(ttls_s))
    ts = acc.frame["ts_ns"].to_numpy().astype(np.int64)
    sizes, d = acc.sizes, acc.distances
    re = d.reaccess
    interval = ts[re] - ts[d.prev[re]]
    nxt = np.full(len(ts), -1, np.int64)
    nxt[d.prev[re]] = np.flatnonzero(re)
    re_bytes, re_sizes = d.bytes[re], sizes[re]
    total, re_total, reaccesses = sizes.sum(), re_sizes.sum(), int(re.sum())
    ttls = sorted(ttls_s)
    ttls_ns = [int(ttl * _NS_PER_S) for ttl in ttls]
    rows = []
    for ttl, ttl_ns, (mean, peak) in zip(ttls, ttls_ns, _residences(ts, nxt, sizes, ttls_ns, int(ts.max())),
                                         strict=True):
        cov = interval <= ttl_ns
        covered = re_sizes[cov].sum()
        # An LRU of ``peak`` bytes hits each re-access whose distance is at most that: a masked sum
        # per TTL rather than a sort and a stable argsort of every re-access (the stream is the
        # whole scenario's; on the whole sample trace's 6th increment 3 ms against 5.5 ms).
        lru_hit = re_sizes[re_bytes <= peak].sum() / total
        rows.append({
            "scenario": scenario, "ttl_s": float(ttl), "reaccesses": reaccesses,
            "covered_reaccesses": int(cov.sum()), "covered_ratio": float(cov.mean()) if cov.size else 0.0,
            "covered_bytes_ratio": float(covered / (re_total if re_total > 0 else np.int64(1))),
            "pinned_mean_bytes": mean, "pinned_peak_bytes": peak,
            "lru_hit_ratio_bytes_at_peak": float(lru_hit),
            "ttl_hit_ratio_bytes": float(covered / total),
        })
    return pl.DataFrame(rows).sort("ttl_s")


def _counted_rows(curves: Curves, scenario: str, ttls: list[float]) -> pl.DataFrame:
    """ttl_coverage's rows from a stream's figures (every access ``curves.size`` bytes)."""
    by_ttl: dict[int, TtlRow] = {row.ttl_ns: row for row in curves.ttl}
    size = np.int64(curves.size)
    reaccesses = int(curves.exact.sum())
    total, re_total = np.int64(curves.accesses) * size, np.int64(reaccesses) * size
    hits = np.cumsum(curves.exact)  # re-accesses at distance up to d blocks
    rows = []
    for ttl in ttls:
        row = by_ttl[int(ttl * _NS_PER_S)]
        covered = np.int64(row.covered) * size
        # an LRU of ``peak`` bytes hits the re-accesses whose distance is at most that
        within = min(row.peak // int(size), hits.shape[0] - 1) if size else hits.shape[0] - 1
        lru = np.int64(hits[within] if within >= 0 else 0) * size
        rows.append({
            "scenario": scenario, "ttl_s": float(ttl), "reaccesses": reaccesses,
            "covered_reaccesses": row.covered,
            "covered_ratio": row.covered / reaccesses if reaccesses else 0.0,
            "covered_bytes_ratio": float(covered / (re_total if re_total > 0 else np.int64(1))),
            "pinned_mean_bytes": row.held / row.span_ns, "pinned_peak_bytes": float(row.peak),
            "lru_hit_ratio_bytes_at_peak": float(lru / total),
            "ttl_hit_ratio_bytes": float(covered / total),
        })
    return pl.DataFrame(rows).sort("ttl_s")


def ttl_coverage_out_of_core(con: duckdb.DuckDBPyConnection, scenario: str, *, work: Path, partitions: int,
                             bytes_per_token: int, ttls_s: Sequence[float] = DEFAULT_TTLS_S,
                             chain: CurvesChain | None = None, rows: int = CHUNK_ROWS) -> pl.DataFrame:
    """Table `ttl_coverage`'s rows of ``scenario`` (``ttl_coverage``'s), read from the lake views on
    ``con`` (``kvlens analyze --out-of-core``).

    The figures are ``requests_curves``' integers (stream_summary.py ``CurvesChain``): the
    re-accesses per distance from the stream read in order in chunks of about ``rows`` accesses on
    one LRU stack, each TTL's covered re-accesses, byte-nanoseconds held, span and peak from each
    access's gaps to its key's previous and next accesses, aggregated in DuckDB by time. The rows
    are made by ``ttl_coverage``'s own code from them: they are its rows exactly. ``chain``: the
    stream's figures when the caller summed them in its own read (``reuse_out_of_core``'s
    ``on_chunk``), for ``ttls_s``. In memory: a chunk and the stack, O(rows + distinct blocks); in
    DuckDB, one row per distinct arrival time. A stream of several block sizes is refused
    (ConfigError). ``work`` and ``partitions`` are not used."""
    del work, partitions
    curves = (chain.done(con, scenario) if chain is not None else
              curves_out_of_core(con, scenario, bytes_per_token=bytes_per_token, rate=None,
                                 ttls_s=tuple(ttls_s), rows=rows))
    return _counted_rows(curves, scenario, sorted(ttls_s))
