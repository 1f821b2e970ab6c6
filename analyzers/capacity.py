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

from collections.abc import Sequence

import duckdb
import numba
import numpy as np
import polars as pl

from kvlens.analyzers.reuse import AccessStream, access_stream
from kvlens.errors import ConfigError, NoDataError

__all__ = ["DEFAULT_TTLS_S", "effective_capacity", "ttl_coverage"]

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
def _peak_in_order(ts: np.ndarray, nxt: np.ndarray, sizes: np.ndarray, ttl_ns: int, cap: int) -> int:
    """The most bytes held just after an access, ``ts`` in time order, in one pass.

    Held after access k: the bytes accessed up to it less those stopped at or before its time
    (stops first at a tie). A residency stops at its expiry (``ts + TTL``, capped) unless the next
    access renews it first; then at that access's time. Both kinds of stop come in time order
    (expiries in their accesses' order, renewals in the renewing accesses'), so two cursors walk
    them beside the accesses: no sort."""
    n = len(ts)
    renewed = np.zeros(n, np.bool_)  # residency i ends at its renewal
    renewing = np.zeros(n, np.int64)  # bytes whose residency access j's renewal stops
    renews = np.zeros(n, np.bool_)
    for i in range(n):
        j = nxt[i]
        if j >= 0 and ts[j] <= ts[i] + ttl_ns:
            renewed[i] = True
            renews[j] = True
            renewing[j] = sizes[i]
    accessed, stopped, peak = 0, 0, -(2**62)
    e, r = 0, 0
    for k in range(n):
        t = ts[k]
        accessed += sizes[k]
        while e < n and (renewed[e] or min(ts[e] + ttl_ns, cap) <= t):
            if not renewed[e]:
                stopped += sizes[e]
            e += 1
        while r < n and (not renews[r] or min(ts[r], cap) <= t):
            if renews[r]:
                stopped += renewing[r]
            r += 1
        peak = max(peak, accessed - stopped)
    return peak


def _residence(ts: np.ndarray, nxt: np.ndarray, sizes: np.ndarray, ttl_ns: int,
               end_ns: int) -> tuple[float, float]:
    """Mean and peak bytes a TTL cache holds; each access keeps its block until min(ts+TTL, next)."""
    if not len(ts):
        return 0.0, 0.0
    cap = max(end_ns, int(ts.max()) + 1)
    stop = np.where(nxt >= 0, np.minimum(ts + ttl_ns, ts[np.maximum(nxt, 0)]), ts + ttl_ns)
    stop = np.minimum(stop, cap)
    span = max(1, int(stop.max()) - int(ts.min()))
    # Byte-nanoseconds overflow int64 with real KV sizes (a 512-token Llama-3.1-70B block held
    # 60 s is 1.0e19): the products are summed in float64 (53-bit mantissa, relative error 1e-16).
    mean = float(np.sum(sizes.astype(np.float64) * (stop - ts).astype(np.float64))) / span
    # Peak: the bytes held just after an access are those accessed up to it less those stopped
    # at or before its time (at a tie a stop comes first: the next access that renews a block
    # stops its previous residency at that access's time). The maximum is reached just after
    # some access, so the accesses (in time order) are the only places to look.
    if bool(np.all(ts[1:] >= ts[:-1])):  # a stream is in time order: one pass
        return mean, float(_peak_in_order(ts, nxt, sizes.astype(np.int64), ttl_ns, cap))
    starts = np.argsort(ts, kind="stable")
    ends = np.sort(stop)
    stop_sizes = np.concatenate([[0], np.cumsum(sizes[np.argsort(stop, kind="stable")])])
    held = np.cumsum(sizes[starts]) - stop_sizes[np.searchsorted(ends, ts[starts], side="right")]
    return mean, float(held.max())


def ttl_coverage(*, request_blocks: duckdb.DuckDBPyRelation, bytes_per_token: int, scenario: str,
                 ttls_s: Sequence[float] = DEFAULT_TTLS_S,
                 stream: AccessStream | None = None) -> pl.DataFrame:
    """One row per TTL for the `requests` stream, sorted by ttl_s.

    Columns: scenario, ttl_s, reaccesses, covered_reaccesses, covered_ratio (of re-accesses),
    covered_bytes_ratio (of re-accessed bytes), pinned_mean_bytes, pinned_peak_bytes,
    lru_hit_ratio_bytes_at_peak (exact LRU byte hit ratio with pinned_peak_bytes of capacity),
    ttl_hit_ratio_bytes (covered re-access bytes over all accessed bytes, to compare with it).
    ``stream``: the scenario's access stream when the caller already built it.
    """
    acc = stream or access_stream(request_blocks, scenario, bytes_per_token)
    ts = acc.frame["ts_ns"].to_numpy().astype(np.int64)
    sizes, d = acc.sizes, acc.distances
    re = d.reaccess
    interval = ts[re] - ts[d.prev[re]]
    nxt = np.full(len(ts), -1, np.int64)
    nxt[d.prev[re]] = np.flatnonzero(re)
    lru_d = np.sort(d.bytes[re])
    lru_w = np.concatenate([[0], np.cumsum(sizes[re][np.argsort(d.bytes[re], kind="stable")])])
    rows = []
    for ttl in sorted(ttls_s):
        ttl_ns = int(ttl * _NS_PER_S)
        cov = interval <= ttl_ns
        mean, peak = _residence(ts, nxt, sizes, ttl_ns, int(ts.max()))
        lru_hit = lru_w[np.searchsorted(lru_d, peak, side="right")] / sizes.sum()
        rows.append({
            "scenario": scenario, "ttl_s": float(ttl), "reaccesses": int(re.sum()),
            "covered_reaccesses": int(cov.sum()), "covered_ratio": float(cov.mean()) if cov.size else 0.0,
            "covered_bytes_ratio": float(sizes[re][cov].sum() / max(1, sizes[re].sum())),
            "pinned_mean_bytes": mean, "pinned_peak_bytes": peak,
            "lru_hit_ratio_bytes_at_peak": float(lru_hit),
            "ttl_hit_ratio_bytes": float(sizes[re][cov].sum() / sizes.sum()),
        })
    return pl.DataFrame(rows).sort("ttl_s")
