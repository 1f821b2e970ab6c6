"""Analyzers: per-request ledger: prompt tokens as hits, misses, the given-back block, the tail.

Hits, the given-back block (``recomputed_last``), misses, unobserved blocks (no KV events from
the replica) and the partial tail add up to the prompt; ``reusable_tokens`` (blocks an earlier
request needed) is the unbounded-cache potential beside them, whatever the events say.
"""

from __future__ import annotations

import duckdb
import polars as pl

from kvlens.schema import HIT_OUTCOMES, Medium, Outcome

__all__ = ["request_ledger"]

# The ledgers' sums are typed as DuckDB's sum of integers (HUGEINT: exact past int64), as they
# have always been written.
SUM_DTYPE = pl.Decimal(38, 0)
_LOCAL_ORIGINS = {"device_hit_tokens": Medium.GPU.value, "host_hit_tokens": Medium.CPU.value,
                  "disk_hit_tokens": Medium.DISK.value}
_SUMS = ["hit_tokens", "recomputed_last_tokens", "miss_tokens", "tail_partial_tokens", "unobserved_tokens",
         "reusable_tokens", *_LOCAL_ORIGINS, "remote_hit_tokens"]


def _per_request(block_outcomes: pl.DataFrame) -> pl.DataFrame:
    """Per request_id: the token sums by outcome and origin, the full blocks' tokens, the dominant miss."""
    outcome, origin = pl.col("outcome").cast(pl.Utf8), pl.col("origin")
    tokens = pl.col("tokens").cast(SUM_DTYPE)
    hit, miss = outcome.is_in(HIT_OUTCOMES), outcome.str.starts_with("miss_")
    per = block_outcomes.group_by("request_id").agg(
        hit_tokens=tokens.filter(hit).sum(),
        recomputed_last_tokens=tokens.filter(outcome == Outcome.RECOMPUTED_LAST.value).sum(),
        miss_tokens=tokens.filter(miss).sum(),
        unobserved_tokens=tokens.filter(outcome == Outcome.UNOBSERVED.value).sum(),
        reusable_tokens=tokens.filter(pl.col("reusable")).sum(),
        **{name: tokens.filter(hit & (origin == tier)).sum() for name, tier in _LOCAL_ORIGINS.items()},
        remote_hit_tokens=tokens.filter(hit & ~origin.is_in(list(_LOCAL_ORIGINS.values()))).sum(),
        full_tokens=tokens.sum())
    # A tie between miss outcomes goes to the first name in order, so the result never depends on row order.
    dominant = (block_outcomes.filter(miss).group_by("request_id", pl.col("outcome").alias("dominant_miss"))
                .agg(by_outcome=tokens.sum())
                .sort(["by_outcome", "dominant_miss"], descending=[True, False], nulls_last=True)
                .group_by("request_id", maintain_order=True).agg(pl.col("dominant_miss").first()))
    return per.join(dominant, on="request_id", how="left")


def request_ledger(*, block_outcomes: pl.DataFrame, requests: duckdb.DuckDBPyRelation,
                   settled: pl.DataFrame | None = None) -> pl.DataFrame:
    """One row per request of ``requests`` (a scenario's rows), with its blocks from ``block_outcomes``.

    ``settled``: rows a previous request ledger wrote (request_id, the token sums,
    tail_partial_tokens, dominant_miss) for requests whose blocks' outcomes have not changed since
    (a continued ledger's settled requests): their sums are taken from there, and
    ``block_outcomes`` need hold only the other requests' rows. Every other column is read again.

    Columns: scenario, replica, request_id, arrival_ns, prompt_tokens, hit_tokens,
    recomputed_last_tokens, miss_tokens, tail_partial_tokens (the prompt beyond its full blocks),
    unobserved_tokens, reusable_tokens, device_hit_tokens, host_hit_tokens, disk_hit_tokens,
    remote_hit_tokens (the hits by where they came from: GPU, CPU, disk, the pool or a peer),
    cached_tokens (the engine's), dominant_miss, ttft_ms, queue_ms. Sorted by arrival, then
    request id.
    """
    req = requests.pl().unique("request_id", keep="first")
    # A frame made before these columns existed: nothing is known of reuse; hits were local.
    if "reusable" not in block_outcomes.columns:
        block_outcomes = block_outcomes.with_columns(reusable=pl.lit(None, pl.Boolean))
    if "origin" not in block_outcomes.columns:
        block_outcomes = block_outcomes.with_columns(origin=pl.lit(Medium.GPU.value))
    beyond = pl.col("prompt_tokens").fill_null(0).cast(SUM_DTYPE) - pl.col("full_tokens").fill_null(0)
    tail = pl.max_horizontal(beyond, pl.lit(0, SUM_DTYPE))
    rows = req.join(_per_request(block_outcomes), on="request_id", how="left").with_columns(
        tail_partial_tokens=tail, dominant_miss=pl.col("dominant_miss").cast(pl.Utf8))
    if settled is not None and settled.height:
        kept = settled.select("request_id", *(pl.col(c).cast(SUM_DTYPE) for c in _SUMS),
                              pl.col("dominant_miss").cast(pl.Utf8))
        rows = pl.concat([rows.filter(~pl.col("request_id").is_in(kept["request_id"].implode())),
                          req.join(kept, on="request_id")], how="diagonal")
    return (rows
            .select("scenario", pl.col("replica").cast(pl.Utf8).fill_null(""), "request_id", "arrival_ns",
                    "prompt_tokens", *(pl.col(c).fill_null(0) for c in _SUMS), "cached_tokens",
                    "dominant_miss", "ttft_ms", "queue_ms")
            .sort("arrival_ns", "request_id", nulls_last=True))
