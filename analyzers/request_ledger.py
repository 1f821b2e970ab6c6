"""Analyzers: per-request ledger: prompt tokens as hits, misses, the given-back block, the tail.

Hits, the given-back block (``recomputed_last``), misses, unobserved blocks (no KV events from
the replica) and the partial tail add up to the prompt; ``reusable_tokens`` (blocks an earlier
request needed) is the unbounded-cache potential beside them, whatever the events say.
"""

from __future__ import annotations

import duckdb
import polars as pl

from kvlens.schema import HIT_OUTCOMES_SQL, Outcome

__all__ = ["request_ledger"]

# Tail tokens are the prompt beyond its full blocks; the engine's cached_tokens sits beside. A tie
# between miss outcomes goes to the first name in order, so the result never depends on row order.
REQUEST_LEDGER_SQL = f"""
WITH per AS (
    SELECT request_id,
           sum(tokens) FILTER (WHERE outcome IN {HIT_OUTCOMES_SQL}) AS hit_tokens,
           sum(tokens) FILTER (WHERE outcome = '{Outcome.RECOMPUTED_LAST.value}') AS recomputed_last_tokens,
           sum(tokens) FILTER (WHERE outcome LIKE 'miss_%') AS miss_tokens,
           sum(tokens) FILTER (WHERE outcome = 'unobserved') AS unobserved_tokens,
           sum(tokens) FILTER (WHERE reusable) AS reusable_tokens,
           sum(tokens) FILTER (WHERE outcome IN {HIT_OUTCOMES_SQL}
                               AND origin = 'gpu') AS device_hit_tokens,
           sum(tokens) FILTER (WHERE outcome IN {HIT_OUTCOMES_SQL}
                               AND origin = 'cpu') AS host_hit_tokens,
           sum(tokens) FILTER (WHERE outcome IN {HIT_OUTCOMES_SQL}
                               AND origin = 'disk') AS disk_hit_tokens,
           sum(tokens) FILTER (WHERE outcome IN {HIT_OUTCOMES_SQL}
                               AND origin NOT IN ('gpu', 'cpu', 'disk')) AS remote_hit_tokens,
           sum(tokens) AS full_tokens,
           first(outcome ORDER BY tokens_by_outcome DESC, outcome) FILTER (WHERE outcome LIKE 'miss_%')
               AS dominant_miss
    FROM (SELECT request_id, outcome, tokens, reusable, origin,
                 sum(tokens) OVER (PARTITION BY request_id, outcome) AS tokens_by_outcome
          FROM block_outcomes)
    GROUP BY request_id
)
SELECT r.scenario, coalesce(r.replica, '') AS replica, r.request_id, r.arrival_ns,
       r.prompt_tokens,
       coalesce(p.hit_tokens, 0) AS hit_tokens,
       coalesce(p.recomputed_last_tokens, 0) AS recomputed_last_tokens,
       coalesce(p.miss_tokens, 0) AS miss_tokens,
       greatest(coalesce(r.prompt_tokens, 0) - coalesce(p.full_tokens, 0), 0) AS tail_partial_tokens,
       coalesce(p.unobserved_tokens, 0) AS unobserved_tokens,
       coalesce(p.reusable_tokens, 0) AS reusable_tokens,
       coalesce(p.device_hit_tokens, 0) AS device_hit_tokens,
       coalesce(p.host_hit_tokens, 0) AS host_hit_tokens,
       coalesce(p.disk_hit_tokens, 0) AS disk_hit_tokens,
       coalesce(p.remote_hit_tokens, 0) AS remote_hit_tokens,
       r.cached_tokens, p.dominant_miss, r.ttft_ms, r.queue_ms
FROM requests r LEFT JOIN per p USING (request_id)
ORDER BY r.arrival_ns, r.request_id
"""


def request_ledger(*, block_outcomes: pl.DataFrame, requests: duckdb.DuckDBPyRelation,
                   scenario: str) -> pl.DataFrame:
    """One row per request of ``scenario``.

    Columns: scenario, replica, request_id, arrival_ns, prompt_tokens, hit_tokens,
    recomputed_last_tokens, miss_tokens, tail_partial_tokens, unobserved_tokens, reusable_tokens,
    device_hit_tokens, host_hit_tokens, disk_hit_tokens, remote_hit_tokens (the hits by where they
    came from: GPU, CPU, disk, the pool or a peer), cached_tokens (the engine's), dominant_miss,
    ttft_ms, queue_ms. Sorted by arrival, then request id.
    """
    cond = duckdb.ColumnExpression("scenario") == duckdb.ConstantExpression(scenario)
    req = requests.filter(cond).pl().unique("request_id", keep="first")
    # A frame made before these columns existed: nothing is known of reuse; hits were local.
    if "reusable" not in block_outcomes.columns:
        block_outcomes = block_outcomes.with_columns(reusable=pl.lit(None, pl.Boolean))
    if "origin" not in block_outcomes.columns:
        block_outcomes = block_outcomes.with_columns(origin=pl.lit("gpu"))
    con = duckdb.connect()
    con.register("block_outcomes", block_outcomes)
    con.register("requests", req)
    return con.sql(REQUEST_LEDGER_SQL).pl()
