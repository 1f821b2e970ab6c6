"""Analyzers: latency tails: TTFT percentiles per replica, time window and prefix class, from the ledger.

Prefix class of a request (from its request_ledger row; recomputed_last and tail tokens are
neither hits nor misses):

- ``full_hit``: no miss tokens, and at least one full block found (hit, or the block given back
  by the one-computed-token rule);
- ``partial_hit``: some hit tokens and some miss tokens;
- ``miss:<outcome>``: no hit tokens and some miss tokens, ``<outcome>`` the dominant miss
  outcome verbatim (``miss:miss_cold``, ``miss:miss_routing``, ...), so ``'miss:' || outcome``
  joins the miss ledger;
- ``no_full_block``: the prompt has no full block (shorter than one block).

Roll-ups, a convention the dashboards and the report rely on: ``replica = '*'`` is all replicas,
``window_start_ns IS NULL`` is the whole scenario, ``prefix_class = 'all'`` is every class.
Rows: every (replica, window, class) cell, then (*, NULL, class), (*, NULL, all),
(replica, NULL, all) and (*, window, all). Windows are aligned to multiples of ``window_ns``
since the epoch. Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import polars as pl

__all__ = ["FLAG_RATIO", "latency_tails"]

FLAG_RATIO = 5.0
ALL_REPLICAS = "*"
ALL_CLASSES = "all"
DEFAULT_WINDOW_NS = 15 * 60 * 1_000_000_000

_COLUMNS = ["scenario", "replica", "window_start_ns", "prefix_class", "requests", "ttft_p50_ms",
            "ttft_p95_ms", "ttft_p99_ms", "p99_p50_ratio", "flagged", "queue_p50_ms", "queue_p99_ms"]


def _classify(ledger: pl.DataFrame, window_ns: int) -> pl.DataFrame:
    hit, miss = pl.col("hit_tokens").fill_null(0), pl.col("miss_tokens").fill_null(0)
    found = hit + pl.col("recomputed_last_tokens").fill_null(0)
    cls = (pl.when((miss == 0) & (found > 0)).then(pl.lit("full_hit"))
           .when((miss > 0) & (hit > 0)).then(pl.lit("partial_hit"))
           .when(miss > 0).then(pl.lit("miss:") + pl.col("dominant_miss").cast(pl.Utf8).fill_null("unknown"))
           .otherwise(pl.lit("no_full_block")))
    return ledger.select(
        "scenario", pl.col("replica").cast(pl.Utf8).fill_null(""),
        window_start_ns=(pl.col("arrival_ns") // window_ns) * window_ns,
        prefix_class=cls, ttft_ms=pl.col("ttft_ms").cast(pl.Float64),
        queue_ms=pl.col("queue_ms").cast(pl.Float64))


def _cells(frame: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    ttft, queue = pl.col("ttft_ms"), pl.col("queue_ms")
    out = frame.group_by(["scenario", *keys]).agg(
        requests=pl.len().cast(pl.Int64),
        ttft_p50_ms=ttft.quantile(0.5, "linear"), ttft_p95_ms=ttft.quantile(0.95, "linear"),
        ttft_p99_ms=ttft.quantile(0.99, "linear"),
        queue_p50_ms=queue.quantile(0.5, "linear"), queue_p99_ms=queue.quantile(0.99, "linear"))
    if "replica" not in keys:
        out = out.with_columns(replica=pl.lit(ALL_REPLICAS))
    if "window_start_ns" not in keys:
        out = out.with_columns(window_start_ns=pl.lit(None, dtype=pl.Int64))
    if "prefix_class" not in keys:
        out = out.with_columns(prefix_class=pl.lit(ALL_CLASSES))
    ratio = pl.when(pl.col("ttft_p50_ms") > 0).then(pl.col("ttft_p99_ms") / pl.col("ttft_p50_ms"))
    return out.with_columns(p99_p50_ratio=ratio).with_columns(
        flagged=pl.col("p99_p50_ratio").fill_null(0.0) > FLAG_RATIO).select(_COLUMNS)


def latency_tails(*, request_ledger: pl.DataFrame, window_ns: int = DEFAULT_WINDOW_NS) -> pl.DataFrame:
    """TTFT P50/P95/P99 and P99/P50 per replica, window and prefix class, with the roll-ups.

    Columns: scenario, replica ('*' for all), window_start_ns (ns; NULL for the whole
    scenario), prefix_class ('all' for every class), requests, ttft_p50_ms, ttft_p95_ms,
    ttft_p99_ms, p99_p50_ratio (NULL when the median is 0), flagged (ratio above 5),
    queue_p50_ms, queue_p99_ms. Percentiles skip requests without a TTFT (queue: without a
    queue time); ``requests`` counts them all. Sorted by scenario, replica, window (NULL
    first), prefix class.
    """
    if window_ns <= 0:
        raise ValueError(f"window_ns must be positive, got {window_ns}")
    frame = _classify(request_ledger, window_ns)
    parts = [
        _cells(frame, ["replica", "window_start_ns", "prefix_class"]),
        _cells(frame, ["prefix_class"]),
        _cells(frame, []),
        _cells(frame, ["replica"]),
        _cells(frame, ["window_start_ns"]),
    ]
    out = pl.concat(parts, how="vertical_relaxed")
    if frame.height == 0:
        out = out.filter(pl.col("requests") > 0)
    return out.sort("scenario", "replica", "window_start_ns", "prefix_class", nulls_last=False)
