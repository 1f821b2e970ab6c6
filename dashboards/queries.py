"""Dashboards: read-only queries over the analysis DB, one Polars frame each (no Streamlit here).

Every filter is a bound parameter (``$scenario``, ``$start_ns``, ``$end_ns``); nothing from the
user is formatted into SQL. A ``Window`` of ``None`` bounds means the whole scenario.
The dashboard pages and the report share these functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import duckdb
import polars as pl

from kvlens.schema import HIT_OUTCOMES, HIT_OUTCOMES_SQL

__all__ = [
    "HIT_OUTCOMES",
    "Window",
    "fetch",
    "hit_ratios",
    "in_window",
    "ledger_by_outcome",
    "pick_bucket_ns",
    "scenario_span_ns",
    "scenarios",
    "table_columns",
    "table_rows",
    "trend",
]


# The bucket widths a trend may use; the first that gives at most _MAX_BUCKETS points wins.
_BUCKETS_NS = tuple(m * 60 * 10**9 for m in (1, 5, 15, 60, 360, 1440))
_MAX_BUCKETS = 30


@dataclass(frozen=True)
class Window:
    """A scenario and an optional arrival-time window [start_ns, end_ns] (inclusive)."""

    scenario: str
    start_ns: int | None = None
    end_ns: int | None = None

    @property
    def whole(self) -> bool:
        return self.start_ns is None and self.end_ns is None

    def params(self, **extra: Any) -> dict[str, Any]:
        return {"scenario": self.scenario, "start_ns": self.start_ns, "end_ns": self.end_ns, **extra}


def fetch(cur: duckdb.DuckDBPyConnection, sql: str, params: dict[str, Any] | None = None) -> pl.DataFrame:
    """Run one bound query; the rows as a Polars frame."""
    return cur.sql(sql, params=params or {}).pl()


# A time predicate on column COL inside the window; the casts let NULL bounds type-check.
def in_window(col: str) -> str:
    """SQL predicate: ``col`` within [$start_ns, $end_ns], either bound may be NULL."""
    return (
        f"(CAST($start_ns AS BIGINT) IS NULL OR {col} >= $start_ns) AND "
        f"(CAST($end_ns AS BIGINT) IS NULL OR {col} <= $end_ns)"
    )


TABLE_COLUMNS_SQL = """
SELECT column_name FROM information_schema.columns
WHERE table_name = $table AND table_schema = 'main' ORDER BY ordinal_position
"""


def table_columns(cur: duckdb.DuckDBPyConnection, table: str) -> list[str]:
    """The table's columns; empty when the DB has no such table (an older analysis DB)."""
    return [r[0] for r in cur.sql(TABLE_COLUMNS_SQL, params={"table": table}).fetchall()]


def table_rows(cur: duckdb.DuckDBPyConnection, table: str, scenario: str | None = None) -> int | None:
    """Rows of ``table`` (for ``scenario`` when given and the table has that column); None if absent.

    ``table`` must be a known analysis table name: it is checked against information_schema
    before it is quoted into the statement, because a table name cannot be bound.
    """
    cols = table_columns(cur, table)
    if not cols:
        return None
    ident = '"' + table.replace('"', '""') + '"'
    if scenario is not None and "scenario" in cols:
        rows = cur.sql(f"SELECT count(*) FROM {ident} WHERE scenario = $s", params={"s": scenario}).fetchall()
    else:
        rows = cur.sql(f"SELECT count(*) FROM {ident}").fetchall()
    return int(rows[0][0])


SCENARIOS_SQL = """
SELECT scenario, model, kv_bytes_per_token, requests, needed_blocks FROM scenarios ORDER BY scenario
"""


def scenarios(cur: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    """``scenario``, ``model``, ``kv_bytes_per_token``, ``requests``, ``needed_blocks``."""
    return fetch(cur, SCENARIOS_SQL)


SPAN_SQL = "SELECT min(arrival_ns), max(arrival_ns) FROM request_ledger WHERE scenario = $scenario"


def scenario_span_ns(cur: duckdb.DuckDBPyConnection, scenario: str) -> tuple[int, int] | None:
    """First and last arrival of the scenario's requests; None when it has none."""
    lo, hi = cur.sql(SPAN_SQL, params={"scenario": scenario}).fetchall()[0]
    return None if lo is None else (int(lo), int(hi))


# The whole-scenario ledger is miss_ledger itself; a window recounts block_outcomes in it.
LEDGER_WHOLE_SQL = """
SELECT scenario, replica, CAST(outcome AS VARCHAR) AS outcome, blocks, tokens, bytes
FROM miss_ledger WHERE scenario = $scenario AND tokens > 0
ORDER BY replica, outcome
"""
LEDGER_WINDOW_SQL = f"""
SELECT scenario, replica, CAST(outcome AS VARCHAR) AS outcome,
       count(*) AS blocks, CAST(sum(tokens) AS BIGINT) AS tokens, CAST(sum(bytes) AS BIGINT) AS bytes
FROM block_outcomes WHERE scenario = $scenario AND {in_window("arrival_ns")}
GROUP BY ALL ORDER BY replica, outcome
"""


def ledger_by_outcome(cur: duckdb.DuckDBPyConnection, window: Window) -> pl.DataFrame:
    """``scenario``, ``replica``, ``outcome``, ``blocks``, ``tokens``, ``bytes`` in the window."""
    if window.whole:
        return fetch(cur, LEDGER_WHOLE_SQL, {"scenario": window.scenario})
    return fetch(cur, LEDGER_WINDOW_SQL, window.params())


RATIOS_SQL = f"""
WITH r AS (
    SELECT count(*) AS requests, CAST(sum(prompt_tokens) AS BIGINT) AS prompt_tokens,
           CAST(sum(hit_tokens) AS BIGINT) AS hit_tokens,
           CAST(sum(coalesce(unobserved_tokens, 0)) AS BIGINT) AS unobserved_tokens,
           CAST(sum(coalesce(reusable_tokens, 0)) AS BIGINT) AS reusable_tokens,
           count(*) FILTER (WHERE events_incomplete) AS incomplete_requests,
           sum(prompt_tokens - coalesce(tail_partial_tokens, 0) - coalesce(unobserved_tokens, 0))
               AS observed_tokens
    FROM request_ledger WHERE scenario = $scenario AND {in_window("arrival_ns")}
), b AS (
    SELECT CAST(sum(bytes) FILTER (WHERE outcome IN {HIT_OUTCOMES_SQL}) AS BIGINT)
           AS hit_bytes
    FROM block_outcomes WHERE scenario = $scenario AND {in_window("arrival_ns")}
)
-- Without KV events from any replica residency is unknown: no hit ratio (NULL), not 0.
SELECT r.requests, r.prompt_tokens, r.hit_tokens,
       CASE WHEN r.observed_tokens > 0 THEN r.hit_tokens / nullif(r.prompt_tokens, 0) END AS token_hit_ratio,
       coalesce(b.hit_bytes, 0) AS hit_bytes,
       r.prompt_tokens * s.kv_bytes_per_token AS prompt_bytes,
       CASE WHEN r.observed_tokens > 0
            THEN coalesce(b.hit_bytes, 0) / nullif(r.prompt_tokens * s.kv_bytes_per_token, 0) END
           AS byte_hit_ratio,
       r.unobserved_tokens, r.reusable_tokens, r.incomplete_requests
FROM r, b, scenarios s WHERE s.scenario = $scenario
"""


def hit_ratios(cur: duckdb.DuckDBPyConnection, window: Window) -> dict[str, Any]:
    """Per token and per byte over every prompt token (tails included) in the window:
    ``requests``, ``prompt_tokens``, ``hit_tokens``, ``token_hit_ratio``, ``hit_bytes``,
    ``prompt_bytes``, ``byte_hit_ratio`` (both None when no replica published KV events),
    ``unobserved_tokens``, ``reusable_tokens``, ``incomplete_requests`` (after an unfillable KV-event
    gap: request_ledger.events_incomplete); empty dict when the scenario has no rows."""
    frame = fetch(cur, RATIOS_SQL, window.params())
    return frame.row(0, named=True) if frame.height else {}


def pick_bucket_ns(span_ns: int) -> int:
    """The narrowest bucket width that draws the span in at most 30 points."""
    for width in _BUCKETS_NS:
        if span_ns // width < _MAX_BUCKETS:
            return width
    return _BUCKETS_NS[-1]


TREND_SQL = f"""
SELECT make_timestamp(CAST((arrival_ns // $bucket_ns) * $bucket_ns // 1000 AS BIGINT)) AS bucket,
       count(*) AS requests, CAST(sum(prompt_tokens) AS BIGINT) AS prompt_tokens,
       CAST(sum(hit_tokens) AS BIGINT) AS hit_tokens,
       sum(hit_tokens) / nullif(sum(prompt_tokens), 0) AS token_hit_ratio
FROM request_ledger WHERE scenario = $scenario AND {in_window("arrival_ns")}
GROUP BY 1 ORDER BY 1
"""


def trend(cur: duckdb.DuckDBPyConnection, window: Window, bucket_ns: int) -> pl.DataFrame:
    """``bucket`` (datetime), ``requests``, ``prompt_tokens``, ``hit_tokens``, ``token_hit_ratio``."""
    return fetch(cur, TREND_SQL, window.params(bucket_ns=bucket_ns))


RECONCILIATION_SQL = """
SELECT replica, sum(engine_queries_tokens) AS engine_queries_tokens,
       sum(engine_hit_tokens + coalesce(engine_external_hit_tokens, 0)) AS engine_hit_tokens,
       sum(ledger_hit_tokens) AS ledger_hit_tokens, sum(reported_cached_tokens) AS reported_cached_tokens,
       sum(difference_tokens) AS difference_tokens,
       sum(difference_tokens) / nullif(sum(engine_hit_tokens + coalesce(engine_external_hit_tokens, 0)), 0)
           AS difference_ratio,
       sum(counter_resets) AS counter_resets
FROM reconciliation WHERE scenario = $scenario
GROUP BY replica ORDER BY replica
"""


def reconciliation(cur: duckdb.DuckDBPyConnection, scenario: str) -> pl.DataFrame:
    """Per replica: the engines' own prefix-cache hit counters beside the ledger's hit tokens."""
    return fetch(cur, RECONCILIATION_SQL, {"scenario": scenario})
