"""Dashboards: the reads the pages and the report share: scenarios, spans, headline totals, ledgers, trends.

Each function takes a cursor, the scenario(s) and a ``Window`` (dashboards/read.py) and returns
a Polars frame, a dict or a frozen record; every filter is a bound parameter. The token and byte
hit ratios are defined once, on ``Headline``, over ``HEADLINE_SQL``'s totals.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import duckdb
import polars as pl

from kvlens.dashboards.read import Window, fetch, in_window, rows
from kvlens.schema import HIT_OUTCOMES_SQL

__all__ = [
    "NAMES_IN_WINDOW",
    "OBSERVED_SQL",
    "Headline",
    "LedgerRow",
    "headlines",
    "hit_ratios",
    "latest_arrivals",
    "ledger",
    "ledger_by_outcome",
    "pick_bucket_ns",
    "reconciliation",
    "scenario_ledgers",
    "scenario_names",
    "scenario_span_ns",
    "scenario_tails",
    "scenarios",
    "trend",
]


# The bucket widths a trend may use; the first that gives at most _MAX_BUCKETS points wins.
_BUCKETS_NS = tuple(m * 60 * 10**9 for m in (1, 5, 15, 60, 360, 1440))
_MAX_BUCKETS = 30

# Headline.observed over request_ledger rows, for queries that aggregate their own groups (a trend's
# buckets, the exporter's replicas): some prompt token ran on a replica that published KV events.
OBSERVED_SQL = "sum(prompt_tokens) - sum(tail_partial_tokens) > sum(coalesce(unobserved_tokens, 0))"

SCENARIOS_SQL = """
SELECT scenario, model, kv_bytes_per_token, requests, needed_blocks FROM scenarios ORDER BY scenario
"""


def scenarios(cur: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    """``scenario``, ``model``, ``kv_bytes_per_token``, ``requests``, ``needed_blocks``."""
    return fetch(cur, SCENARIOS_SQL)


SCENARIO_NAMES_SQL = "SELECT DISTINCT scenario FROM request_ledger ORDER BY 1"


def scenario_names(cur: duckdb.DuckDBPyConnection, chosen: list[str] | None) -> list[str]:
    """The analyzed scenarios (or the chosen ones that were analyzed), sorted."""
    present = [r[0] for r in rows(cur, SCENARIO_NAMES_SQL)]
    if not chosen:
        return present
    return sorted(s for s in set(chosen) if s in present)


SPAN_SQL = "SELECT min(arrival_ns), max(arrival_ns) FROM request_ledger WHERE scenario = $scenario"


def scenario_span_ns(cur: duckdb.DuckDBPyConnection, scenario: str) -> tuple[int, int] | None:
    """First and last arrival of the scenario's requests; None when it has none."""
    ((lo, hi),) = rows(cur, SPAN_SQL, {"scenario": scenario})
    return None if lo is None else (int(lo), int(hi))


LATEST_SQL = """
SELECT scenario, max(arrival_ns) FROM request_ledger WHERE list_contains($names, scenario)
GROUP BY scenario ORDER BY scenario
"""


def latest_arrivals(cur: duckdb.DuckDBPyConnection, names: list[str]) -> dict[str, int]:
    """Per scenario: just after its latest arrival (a replayed trace keeps its own epoch)."""
    return {s: int(t) + 1 for s, t in rows(cur, LATEST_SQL, {"names": names}) if t is not None}


@dataclass(frozen=True)
class Headline:
    """One scenario's totals in a window."""

    scenario: str
    requests: int
    prompt_tokens: int
    hit_tokens: int
    tail_partial_tokens: int
    hit_bytes: int
    prompt_bytes: int | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    unobserved_tokens: int = 0
    incomplete_requests: int = 0  # after an unfillable KV-event gap (request_ledger.events_incomplete)
    reusable_tokens: int = 0  # what an unbounded cache could have served (modelled)

    @property
    def observed(self) -> bool:
        """Some prompt token ran on a replica that published KV events (else no ratio is known); in
        SQL, ``OBSERVED_SQL``."""
        return self.prompt_tokens - self.tail_partial_tokens > self.unobserved_tokens

    @property
    def token_hit_ratio(self) -> float | None:
        """Hit tokens over prompt tokens (partial tails count as recomputed); None without events."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens and self.observed else None

    @property
    def byte_hit_ratio(self) -> float | None:
        """Hit KV bytes over the KV bytes of every prompt token (tails included); None without events."""
        return self.hit_bytes / self.prompt_bytes if self.prompt_bytes and self.observed else None


# The named scenarios' requests (or blocks) that arrived in the window.
NAMES_IN_WINDOW = f"list_contains($names, scenario) AND {in_window('arrival_ns')}"

HEADLINE_SQL = f"""
WITH r AS (
    SELECT scenario, count(*) AS requests, sum(prompt_tokens) AS prompt_tokens,
           sum(hit_tokens) AS hit_tokens, sum(tail_partial_tokens) AS tail_partial_tokens,
           median(ttft_ms) AS ttft_p50_ms, quantile_cont(ttft_ms, 0.99) AS ttft_p99_ms,
           sum(coalesce(unobserved_tokens, 0)) AS unobserved_tokens,
           count(*) FILTER (WHERE events_incomplete) AS incomplete_requests,
           sum(coalesce(reusable_tokens, 0)) AS reusable_tokens
    FROM request_ledger WHERE {NAMES_IN_WINDOW} GROUP BY scenario
), b AS (
    SELECT scenario, sum(bytes) FILTER (WHERE outcome IN {HIT_OUTCOMES_SQL}) AS hit_bytes
    FROM block_outcomes WHERE {NAMES_IN_WINDOW} GROUP BY scenario
)
SELECT r.scenario, r.requests, r.prompt_tokens, r.hit_tokens, r.tail_partial_tokens,
       coalesce(b.hit_bytes, 0), r.prompt_tokens * s.kv_bytes_per_token, r.ttft_p50_ms, r.ttft_p99_ms,
       r.unobserved_tokens, r.incomplete_requests, r.reusable_tokens
FROM r LEFT JOIN b USING (scenario) LEFT JOIN scenarios s USING (scenario) ORDER BY r.scenario
"""


def headlines(cur: duckdb.DuckDBPyConnection, names: list[str], window: Window) -> dict[str, Headline]:
    """Per scenario with requests in the window: its totals."""
    out = {}
    for r in rows(cur, HEADLINE_SQL, window.params(names=names)):
        out[r[0]] = Headline(r[0], int(r[1]), int(r[2] or 0), int(r[3] or 0), int(r[4] or 0), int(r[5]),
                             None if r[6] is None else int(r[6]), r[7], r[8], int(r[9] or 0),
                             int(r[10] or 0), int(r[11] or 0))
    return out


def hit_ratios(cur: duckdb.DuckDBPyConnection, scenario: str, window: Window) -> dict[str, Any]:
    """The scenario's ``Headline`` in the window as a dict, with ``token_hit_ratio`` and
    ``byte_hit_ratio`` (both None when no replica published KV events); empty when no request
    arrived in the window."""
    found = headlines(cur, [scenario], window).get(scenario)
    if found is None:
        return {}
    return {**asdict(found), "token_hit_ratio": found.token_hit_ratio, "byte_hit_ratio": found.byte_hit_ratio}


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


def ledger_by_outcome(cur: duckdb.DuckDBPyConnection, scenario: str, window: Window) -> pl.DataFrame:
    """``scenario``, ``replica``, ``outcome``, ``blocks``, ``tokens``, ``bytes`` in the window."""
    sql = LEDGER_WHOLE_SQL if window.whole else LEDGER_WINDOW_SQL
    return fetch(cur, sql, window.params(scenario=scenario))


SCENARIO_LEDGERS_WHOLE_SQL = """
SELECT scenario, CAST(outcome AS VARCHAR) AS outcome, CAST(sum(tokens) AS BIGINT) AS tokens,
       CAST(sum(bytes) AS BIGINT) AS bytes
FROM miss_ledger WHERE list_contains($names, scenario) GROUP BY ALL ORDER BY scenario, outcome
"""
SCENARIO_LEDGERS_WINDOW_SQL = f"""
SELECT scenario, CAST(outcome AS VARCHAR) AS outcome, CAST(sum(tokens) AS BIGINT) AS tokens,
       CAST(sum(bytes) AS BIGINT) AS bytes
FROM block_outcomes WHERE {NAMES_IN_WINDOW}
GROUP BY ALL ORDER BY scenario, outcome
"""


def scenario_ledgers(cur: duckdb.DuckDBPyConnection, names: list[str], window: Window) -> pl.DataFrame:
    """``scenario``, ``outcome``, ``tokens``, ``bytes`` for each named scenario, in the window."""
    sql = SCENARIO_LEDGERS_WHOLE_SQL if window.whole else SCENARIO_LEDGERS_WINDOW_SQL
    return fetch(cur, sql, window.params(names=names))


@dataclass(frozen=True)
class LedgerRow:
    scenario: str
    outcome: str
    tokens: int
    bytes: int


def ledger(cur: duckdb.DuckDBPyConnection, names: list[str], window: Window) -> list[LedgerRow]:
    """Tokens and bytes per scenario and outcome for the window's requests (``block_outcomes``)."""
    found = rows(cur, SCENARIO_LEDGERS_WINDOW_SQL, window.params(names=names))
    return [LedgerRow(s, o, int(t), int(b)) for s, o, t, b in found]


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
       CASE WHEN {OBSERVED_SQL} THEN sum(hit_tokens) / nullif(sum(prompt_tokens), 0) END AS token_hit_ratio
FROM request_ledger WHERE scenario = $scenario AND {in_window("arrival_ns")}
GROUP BY 1 ORDER BY 1
"""


def trend(cur: duckdb.DuckDBPyConnection, scenario: str, window: Window, bucket_ns: int) -> pl.DataFrame:
    """``bucket`` (datetime), ``requests``, ``prompt_tokens``, ``hit_tokens``, ``token_hit_ratio``
    (``Headline``'s rule per bucket: NULL where no prompt token ran on a replica that published KV
    events, so a trace without events draws no line at 0%)."""
    return fetch(cur, TREND_SQL, window.params(scenario=scenario, bucket_ns=bucket_ns))


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


TAILS_COLS = "requests, ttft_p50_ms, ttft_p95_ms, ttft_p99_ms, p99_p50_ratio, queue_p50_ms"
SCENARIO_TAILS_SQL = f"""
SELECT scenario, {TAILS_COLS} FROM latency_tails
WHERE list_contains($names, scenario) AND replica = '*' AND window_start_ns IS NULL
  AND prefix_class = 'all' ORDER BY scenario
"""


def scenario_tails(cur: duckdb.DuckDBPyConnection, names: list[str]) -> pl.DataFrame:
    """Whole-scenario, all-replica, all-class tails for each named scenario: ``scenario``, ``requests``,
    ``ttft_p50_ms``, ``ttft_p95_ms``, ``ttft_p99_ms``, ``p99_p50_ratio``, ``queue_p50_ms``."""
    return fetch(cur, SCENARIO_TAILS_SQL, {"names": names})
