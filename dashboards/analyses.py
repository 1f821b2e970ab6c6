"""Dashboards: read-only queries behind the analysis pages (no Streamlit here).

Each function takes a cursor, the scenario and, where the time window applies, a ``Window``
(dashboards/read.py), and returns a Polars frame shaped for one chart or table of
``dashboards.charts``; filters are bound parameters. What the report shares is in dashboards/queries.py.
"""

from __future__ import annotations

import duckdb
import polars as pl

from kvlens.dashboards.queries import TAILS_COLS
from kvlens.dashboards.read import Window, fetch, in_window, rows, table_columns

__all__ = [
    "capacity_marks",
    "crossover",
    "crossover_series",
    "fanout",
    "flows",
    "flows_long",
    "hygiene_by_split",
    "hygiene_offenders",
    "hygiene_requests",
    "isolation_findings",
    "latency_by_class",
    "latency_by_replica",
    "latency_trend",
    "mrc_curve",
    "mrc_streams",
    "outcome_replicas",
    "outcome_requests",
    "outcome_totals",
    "prefix_ranking",
    "request_blocks",
    "ttl_coverage",
    "warmup",
    "worst_tail",
]

_TS = "make_timestamp(CAST({col} // 1000 AS BIGINT))"

OUTCOME_REPLICAS_SQL = f"""
SELECT replica, count(*) AS blocks, CAST(sum(tokens) AS BIGINT) AS tokens, CAST(sum(bytes) AS BIGINT) AS bytes
FROM block_outcomes
WHERE scenario = $scenario AND CAST(outcome AS VARCHAR) = $outcome AND {in_window("arrival_ns")}
GROUP BY replica ORDER BY tokens DESC, replica
"""


def outcome_replicas(cur: duckdb.DuckDBPyConnection, scenario: str, window: Window,
                     outcome: str) -> pl.DataFrame:
    """``replica``, ``blocks``, ``tokens``, ``bytes`` of one outcome, most tokens first."""
    return fetch(cur, OUTCOME_REPLICAS_SQL, window.params(scenario=scenario, outcome=outcome))


OUTCOME_REQUESTS_SQL = f"""
SELECT b.request_id, {_TS.format(col="min(b.arrival_ns)")} AS arrival, count(*) AS blocks,
       CAST(sum(b.tokens) AS BIGINT) AS tokens, CAST(sum(b.bytes) AS BIGINT) AS bytes,
       any_value(r.prompt_tokens) AS prompt_tokens, any_value(r.ttft_ms) AS ttft_ms,
       string_agg(DISTINCT b.holder, ', ' ORDER BY b.holder) AS holders,
       string_agg(DISTINCT b.remover, ', ' ORDER BY b.remover) AS removers,
       string_agg(DISTINCT b.key_diff, ', ' ORDER BY b.key_diff) AS key_diffs
FROM block_outcomes b
LEFT JOIN request_ledger r ON r.scenario = b.scenario AND r.request_id = b.request_id
WHERE b.scenario = $scenario AND CAST(b.outcome AS VARCHAR) = $outcome AND b.replica = $replica
  AND {in_window("b.arrival_ns")}
GROUP BY b.request_id ORDER BY tokens DESC, b.request_id LIMIT $limit
"""


def outcome_requests(
    cur: duckdb.DuckDBPyConnection, scenario: str, window: Window, outcome: str, replica: str,
    limit: int = 200,
) -> pl.DataFrame:
    """The requests behind one outcome on one replica, most tokens first: ``request_id``,
    ``arrival``, ``blocks``, ``tokens``, ``bytes``, ``prompt_tokens``, ``ttft_ms``, ``holders``,
    ``removers``, ``key_diffs``."""
    params = window.params(scenario=scenario, outcome=outcome, replica=replica, limit=limit)
    return fetch(cur, OUTCOME_REQUESTS_SQL, params)


REQUEST_BLOCKS_SQL = f"""
SELECT position, printf('%016x', block_hash) AS block_hash, CAST(outcome AS VARCHAR) AS outcome,
       tokens, bytes, holder, {_TS.format(col="removed_ns")} AS removed, remover, key_diff
FROM block_outcomes WHERE scenario = $scenario AND request_id = $request_id ORDER BY position
"""


def request_blocks(cur: duckdb.DuckDBPyConnection, scenario: str, request_id: str) -> pl.DataFrame:
    """Every needed full block of one request with its outcome and evidence."""
    return fetch(cur, REQUEST_BLOCKS_SQL, {"scenario": scenario, "request_id": request_id})


# Every column the analysis wrote (newer kvlens versions add some), the hashes in hex.
PREFIX_RANKING_SQL = """
SELECT printf('%016x', prefix_hash) AS prefix, * EXCLUDE (scenario, prefix_hash)
FROM prefix_ranking WHERE scenario = $scenario ORDER BY benefit_ms DESC, prefix LIMIT $limit
"""
_FIRST_RANKING_COLUMNS = (
    "prefix",
    "recommendation",
    "benefit_ms",
    "reason",
    "prefix_tokens",
    "reuses",
    "replicas",
    "bytes",
)


def prefix_ranking(cur: duckdb.DuckDBPyConnection, scenario: str, limit: int = 50) -> pl.DataFrame:
    """Top prefixes by expected benefit: ``prefix`` (hex), ``recommendation``, ``benefit_ms``,
    ``reason``, ``prefix_tokens``, ``reuses``, ``replicas``, ``bytes``, then any further columns."""
    frame = fetch(cur, PREFIX_RANKING_SQL, {"scenario": scenario, "limit": limit})
    if "parent_hash" in frame.columns:
        frame = frame.with_columns(
            pl.col("parent_hash").map_elements(lambda h: f"{h:016x}", return_dtype=pl.String)
        )
    first = [c for c in _FIRST_RANKING_COLUMNS if c in frame.columns]
    return frame.select(first + [c for c in frame.columns if c not in first])


MRC_STREAMS_SQL = (
    "SELECT DISTINCT stream FROM mrc WHERE scenario = $scenario ORDER BY stream = 'requests' DESC, 1"
)
MRC_SQL = """
SELECT method, capacity_blocks, capacity_bytes, hit_ratio_blocks, hit_ratio_bytes
FROM mrc WHERE scenario = $scenario AND stream = $stream ORDER BY method, capacity_bytes
"""
CAPACITY_SQL = "SELECT * FROM capacity WHERE scenario = $scenario"


def mrc_streams(cur: duckdb.DuckDBPyConnection, scenario: str) -> list[str]:
    """The scenario's curve streams, ``requests`` first."""
    return [r[0] for r in rows(cur, MRC_STREAMS_SQL, {"scenario": scenario})]


def mrc_curve(cur: duckdb.DuckDBPyConnection, scenario: str, stream: str) -> pl.DataFrame:
    """``method``, ``capacity_blocks``, ``capacity_bytes``, ``hit_ratio_blocks``, ``hit_ratio_bytes``."""
    return fetch(cur, MRC_SQL, {"scenario": scenario, "stream": stream})


def capacity_marks(cur: duckdb.DuckDBPyConnection, scenario: str) -> pl.DataFrame:
    """The ``capacity`` row(s) of the scenario plus ``label`` and a twice-C_eff mark."""
    found = fetch(cur, CAPACITY_SQL, {"scenario": scenario})
    if found.height == 0:
        return found.with_columns(pl.lit("").alias("label"))
    terms = ("c_active_decode_bytes", "c_reserved_bytes", "c_fragmentation_bytes")
    nothing = pl.sum_horizontal(*terms) == 0
    eff = found.with_columns(pl.when(nothing).then(pl.lit("C_eff = C_physical")).otherwise(pl.lit("C_eff"))
                             .alias("label"))
    twice = found.with_columns(
        (pl.col("c_eff_bytes") * 2).alias("c_eff_bytes"), pl.lit("2 x C_eff").alias("label")
    )
    return pl.concat([eff, twice])


TTL_SQL = "SELECT * FROM ttl_coverage WHERE scenario = $scenario ORDER BY ttl_s"
WARMUP_SQL = f"""
SELECT replica, {_TS.format(col="first_request_ns")} AS first_request,
       steady_after_ns / 1e9 AS steady_after_s,
       * EXCLUDE (scenario, replica, first_request_ns, steady_after_ns)
FROM warmup WHERE scenario = $scenario ORDER BY replica, first_request_ns
"""


def ttl_coverage(cur: duckdb.DuckDBPyConnection, scenario: str) -> pl.DataFrame:
    """The ``ttl_coverage`` rows of the scenario, shortest TTL first."""
    return fetch(cur, TTL_SQL, {"scenario": scenario})


def warmup(cur: duckdb.DuckDBPyConnection, scenario: str) -> pl.DataFrame:
    """``replica``, ``first_request``, ``steady_after_s``, then the table's further columns."""
    return fetch(cur, WARMUP_SQL, {"scenario": scenario})


FLOWS_SQL = f"""
SELECT {_TS.format(col="window_start_ns")} AS window, replica, CAST(tier AS VARCHAR) AS tier,
       read_bytes, write_bytes, replica_bytes, never_read_bytes
FROM flows WHERE scenario = $scenario AND {in_window("window_start_ns")}
ORDER BY window_start_ns, replica, tier
"""


def flows(cur: duckdb.DuckDBPyConnection, scenario: str, window: Window) -> pl.DataFrame:
    """``window`` (datetime), ``replica``, ``tier``, ``read_bytes``, ``write_bytes``,
    ``replica_bytes``, ``never_read_bytes``; a replica ``*`` roll-up, when present, is kept alone."""
    frame = fetch(cur, FLOWS_SQL, window.params(scenario=scenario))
    if (frame["replica"] == "*").any():
        frame = frame.filter(pl.col("replica") == "*")
    return frame


def flows_long(frame: pl.DataFrame) -> pl.DataFrame:
    """Per window and flow kind: ``window``, ``flow`` (read, write, replica, never_read), ``bytes``."""
    kinds = {
        "read_bytes": "read",
        "write_bytes": "write",
        "replica_bytes": "replica",
        "never_read_bytes": "never_read",
    }
    long = frame.unpivot(index=["window"], on=list(kinds), variable_name="flow", value_name="bytes")
    return (
        long.with_columns(pl.col("flow").replace_strict(kinds), pl.col("bytes").fill_null(0))
        .group_by("window", "flow")
        .agg(pl.col("bytes").sum())
        .sort("window", "flow")
    )


FANOUT_SQL = f"""
SELECT {_TS.format(col="window_start_ns")} AS window, * EXCLUDE (scenario, window_start_ns)
FROM fanout WHERE scenario = $scenario AND {in_window("window_start_ns")} ORDER BY window_start_ns
"""


def fanout(cur: duckdb.DuckDBPyConnection, scenario: str, window: Window) -> pl.DataFrame:
    """``window`` (datetime) and the ``fanout`` columns per window, in time order."""
    return fetch(cur, FANOUT_SQL, window.params(scenario=scenario))


LATENCY_CLASS_SQL = f"""
SELECT prefix_class, {TAILS_COLS} FROM latency_tails
WHERE scenario = $scenario AND replica = '*' AND window_start_ns IS NULL ORDER BY prefix_class
"""
LATENCY_TREND_SQL = f"""
SELECT {_TS.format(col="window_start_ns")} AS window, prefix_class, {TAILS_COLS} FROM latency_tails
WHERE scenario = $scenario AND replica = '*' AND window_start_ns IS NOT NULL
  AND {in_window("window_start_ns")}
ORDER BY window_start_ns, prefix_class
"""
LATENCY_REPLICA_SQL = f"""
SELECT replica, {TAILS_COLS} FROM latency_tails
WHERE scenario = $scenario AND replica <> '*' AND window_start_ns IS NULL AND prefix_class = 'all'
ORDER BY p99_p50_ratio DESC NULLS LAST, replica
"""
# A P99 of a handful of requests says little: cells under $min_requests are left out.
WORST_TAIL_SQL = f"""
SELECT replica, {_TS.format(col="window_start_ns")} AS window, prefix_class, {TAILS_COLS}
FROM latency_tails
WHERE scenario = $scenario AND prefix_class = 'all' AND p99_p50_ratio IS NOT NULL
  AND requests >= $min_requests
  AND (window_start_ns IS NULL OR ({in_window("window_start_ns")}))
ORDER BY p99_p50_ratio DESC, replica LIMIT 1
"""


def latency_by_class(cur: duckdb.DuckDBPyConnection, scenario: str) -> pl.DataFrame:
    """Whole-scenario, all-replica tails per ``prefix_class``."""
    return fetch(cur, LATENCY_CLASS_SQL, {"scenario": scenario})


def latency_trend(cur: duckdb.DuckDBPyConnection, scenario: str, window: Window) -> pl.DataFrame:
    """All-replica tails per time ``window`` and ``prefix_class`` inside the window."""
    return fetch(cur, LATENCY_TREND_SQL, window.params(scenario=scenario))


def latency_by_replica(cur: duckdb.DuckDBPyConnection, scenario: str) -> pl.DataFrame:
    """Whole-scenario tails of every class together, per replica, worst P99/P50 first."""
    return fetch(cur, LATENCY_REPLICA_SQL, {"scenario": scenario})


def worst_tail(cur: duckdb.DuckDBPyConnection, scenario: str, window: Window,
               min_requests: int = 20) -> dict[str, object]:
    """The cell (replica, window) of at least ``min_requests`` with the highest P99/P50 over all
    classes; {} when none."""
    frame = fetch(cur, WORST_TAIL_SQL, window.params(scenario=scenario, min_requests=min_requests))
    return frame.row(0, named=True) if frame.height else {}


# {order}: column names from information_schema, never from the user.
CROSSOVER_SQL = "SELECT * EXCLUDE (scenario) FROM crossover WHERE scenario = $scenario ORDER BY {order}"
CROSSOVER_ALL_SQL = "SELECT * FROM crossover ORDER BY {order}"


def crossover(cur: duckdb.DuckDBPyConnection, scenario: str) -> pl.DataFrame | None:
    """The scenario's ``crossover`` rows (all rows when the table has no scenario column);
    None when the DB has no such table."""
    cols = table_columns(cur, "crossover")
    if not cols:
        return None
    order = ", ".join(c for c in ("path", "prefix_tokens") if c in cols) or "1"
    sql = CROSSOVER_SQL if "scenario" in cols else CROSSOVER_ALL_SQL
    return fetch(cur, sql.format(order=order), {"scenario": scenario})


def crossover_series(frame: pl.DataFrame) -> pl.DataFrame | None:
    """Long form for ``charts.crossover_chart``: ``prefix_tokens``, ``series``, ``ms``, ``label``;
    None when the table lacks ``prefix_tokens``, ``recompute_ms`` or ``load_ms``."""
    if not {"prefix_tokens", "recompute_ms", "load_ms"} <= set(frame.columns):
        return None

    def label(kind: str) -> pl.Expr:
        name = next((c for c in (f"{kind}_label", "label", "source") if c in frame.columns), None)
        return pl.col(name).cast(pl.String) if name else pl.lit("")

    path = pl.col("path").cast(pl.String) if "path" in frame.columns else pl.lit("load")
    load = frame.select(
        "prefix_tokens",
        pl.concat_str(pl.lit("load "), path).alias("series"),
        pl.col("load_ms").alias("ms"),
        label("load").alias("label"),
    )
    recompute = frame.select(
        "prefix_tokens",
        pl.lit("recompute").alias("series"),
        pl.col("recompute_ms").alias("ms"),
        label("recompute").alias("label"),
    ).unique(subset=["prefix_tokens"], keep="first", maintain_order=True)
    return pl.concat([recompute, load]).drop_nulls("ms").sort("series", "prefix_tokens")


ISOLATION_SQL = """
SELECT finding, subject, blocks, detail, * EXCLUDE (scenario, finding, subject, blocks, detail)
FROM isolation_findings WHERE scenario = $scenario ORDER BY blocks DESC, finding, subject
"""


def isolation_findings(cur: duckdb.DuckDBPyConnection, scenario: str) -> pl.DataFrame:
    """``finding``, ``subject``, ``blocks``, ``detail``, then any further columns (``severity``, ...),
    most blocks first."""
    return fetch(cur, ISOLATION_SQL, {"scenario": scenario})


# A hygiene row is in the window when its request's ledger arrival is.
HYGIENE_WHERE = f"""
FROM hygiene h LEFT JOIN request_ledger r ON r.scenario = h.scenario AND r.request_id = h.request_id
WHERE h.scenario = $scenario AND {in_window("r.arrival_ns")}
"""
HYGIENE_SPLIT_SQL = f"""
SELECT h.split_position, count(*) AS requests, CAST(sum(h.lost_tokens) AS BIGINT) AS lost_tokens,
       CAST(sum(h.lost_bytes) AS BIGINT) AS lost_bytes {HYGIENE_WHERE}
GROUP BY 1 ORDER BY 1
"""
HYGIENE_REQUESTS_SQL = f"""
SELECT h.request_id, r.replica, {_TS.format(col="r.arrival_ns")} AS arrival,
       h.* EXCLUDE (scenario, request_id) {HYGIENE_WHERE}
ORDER BY h.lost_tokens DESC, h.request_id LIMIT $limit
"""


def hygiene_by_split(cur: duckdb.DuckDBPyConnection, scenario: str, window: Window) -> pl.DataFrame:
    """``split_position``, ``requests``, ``lost_tokens``, ``lost_bytes``."""
    return fetch(cur, HYGIENE_SPLIT_SQL, window.params(scenario=scenario))


def hygiene_requests(cur: duckdb.DuckDBPyConnection, scenario: str, window: Window,
                     limit: int = 100) -> pl.DataFrame:
    """The top offenders by tokens lost: ``request_id``, ``replica``, ``arrival``, then the hygiene
    columns (``split_position``, ``lost_tokens``, ``lost_bytes``, ...)."""
    frame = fetch(cur, HYGIENE_REQUESTS_SQL, window.params(scenario=scenario, limit=limit))
    return frame.drop("arrival_ns", strict=False)  # newer hygiene tables repeat it; ``arrival`` shows it


HYGIENE_OFFENDERS_SQL = f"""
SELECT h.offender_rank, h.first_request_id, count(*) AS requests,
       CAST(sum(h.lost_tokens) AS BIGINT) AS lost_tokens, CAST(sum(h.lost_bytes) AS BIGINT) AS lost_bytes,
       min(h.split_position) AS split_position {HYGIENE_WHERE}
GROUP BY 1, 2 ORDER BY 1 NULLS LAST, 2 LIMIT $limit
"""


def hygiene_offenders(cur: duckdb.DuckDBPyConnection, scenario: str, window: Window,
                      limit: int = 20) -> pl.DataFrame | None:
    """Offender groups (requests sharing the repeated content after the same prefix), worst first:
    ``offender_rank``, ``first_request_id``, ``requests``, ``lost_tokens``, ``lost_bytes``,
    ``split_position``; None when the hygiene table has no offender columns."""
    if not {"offender_rank", "first_request_id"} <= set(table_columns(cur, "hygiene")):
        return None
    return fetch(cur, HYGIENE_OFFENDERS_SQL, window.params(scenario=scenario, limit=limit))


def outcome_totals(ledger: pl.DataFrame) -> pl.DataFrame:
    """A ledger frame's blocks, tokens and bytes per outcome, with each outcome's share of tokens."""
    totals = ledger.group_by("outcome").agg(
        pl.col("blocks").sum(), pl.col("tokens").sum(), pl.col("bytes").sum()
    )
    return totals.with_columns((pl.col("tokens") / pl.col("tokens").sum()).alias("share")).sort(
        "tokens", descending=True
    )
