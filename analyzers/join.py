"""Analyzers: one row per request from several sources: gateway blocks, engine span timings, API usage.

A scenario's ``requests`` (typically from a gateway log, with replica and blocks) is joined by
request id with the ``requests`` of other scenarios (an OTLP span import, an API usage log):
a column the scenario lacks (NULL) is taken from the first joined source that has it. The
sources' clocks differ, so the offset of each source is estimated as the median of
``source.arrival_ns − scenario.arrival_ns`` over the matched requests (with its interquartile
range) and reported; times are not shifted, since the ledger's look-up time comes from the
scenario's own clock.
"""

from __future__ import annotations

from collections.abc import Sequence

import duckdb
import polars as pl

__all__ = ["FILLED_COLUMNS", "join_sources"]

# Columns a joined source may fill where the scenario's row has NULL.
FILLED_COLUMNS = ("first_token_ns", "end_ns", "replica", "model", "tenant", "session_id", "output_tokens",
                  "cached_tokens", "ttft_ms", "queue_ms", "prefill_ms")


def _rows(requests: duckdb.DuckDBPyRelation, scenario: str) -> pl.DataFrame:
    cond = duckdb.ColumnExpression("scenario") == duckdb.ConstantExpression(scenario)
    return requests.filter(cond).pl().unique("request_id", keep="first", maintain_order=True)


def _report(scenario: str, source: str, base: pl.DataFrame, other: pl.DataFrame) -> dict[str, object]:
    matched = base.join(other.select("request_id", other_arrival="arrival_ns"), on="request_id")
    offsets = (matched["other_arrival"] - matched["arrival_ns"]).drop_nulls().cast(pl.Float64) / 1e6
    kinds = other["source"].drop_nulls().unique().sort().to_list()
    return {
        "scenario": scenario, "source_scenario": source, "source": ",".join(kinds) or None,
        "requests": base.height, "matched": matched.height, "missing": base.height - matched.height,
        "only_in_source": other.join(base, on="request_id", how="anti").height,
        "clock_offset_ms": offsets.median() if offsets.len() else None,
        "clock_offset_iqr_ms": (offsets.quantile(0.75) - offsets.quantile(0.25))  # type: ignore[operator]
        if offsets.len() else None,
    }


def join_sources(*, requests: duckdb.DuckDBPyRelation, scenario: str,
                 sources: Sequence[str]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The scenario's requests with NULL columns filled from ``sources``, and a report.

    Returns (requests, report). ``requests`` has the columns of table `requests`, one row per
    request id of ``scenario``, in its original order. ``report`` has one row per source
    scenario: scenario, source_scenario, source (formats seen), requests, matched, missing
    (scenario requests the source lacks), only_in_source, clock_offset_ms (median of source
    minus scenario arrival over matched requests), clock_offset_iqr_ms.
    """
    base = _rows(requests, scenario)
    joined = base
    reports = []
    for source in sources:
        other = _rows(requests, source)
        reports.append(_report(scenario, source, base, other))
        fill = other.select("request_id", *[pl.col(c).alias(f"{c}__src") for c in FILLED_COLUMNS])
        joined = (joined.join(fill, on="request_id", how="left", maintain_order="left")
                  .with_columns([pl.coalesce(c, f"{c}__src").alias(c) for c in FILLED_COLUMNS])
                  .drop([f"{c}__src" for c in FILLED_COLUMNS]))
    report = pl.DataFrame(reports, schema={
        "scenario": pl.String, "source_scenario": pl.String, "source": pl.String, "requests": pl.Int64,
        "matched": pl.Int64, "missing": pl.Int64, "only_in_source": pl.Int64,
        "clock_offset_ms": pl.Float64, "clock_offset_iqr_ms": pl.Float64})
    return joined.select(base.columns), report
