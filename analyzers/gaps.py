"""Analyzers: the collector's unfillable KV-event gaps -> the ledger rows whose events are incomplete.

When a publisher's replay no longer holds batches the live collector missed, it records a
``metric_samples`` row named ``kvlens_collector_gap_batches`` (collector/live.py: value = batches
lost; labels publisher, from_seq, to_seq; ``ts_ns`` = when the collector saw the gap). The
stores and removals in those batches are unknown, so the residency the replay rebuilds for that
replica may be wrong from the gap on, until the replica's cache is known again: a ``cleared``
event (an engine restart or a cache reset empties it). A gap starts at the engine time of the
last batch before it (``from_seq - 1``; else the replica's last event before the gap was seen;
else the moment it was seen).

A request is ``events_incomplete`` when its replica had a gap that started at or before its
arrival with no clear in between; a ``miss_ledger`` row is when any of its blocks belongs to
such a request. Both are flags on the ledger's numbers, never a change to them.
"""

from __future__ import annotations

import duckdb
import polars as pl

__all__ = ["GAP_METRIC", "event_gaps", "mark_incomplete"]

GAP_METRIC = "kvlens_collector_gap_batches"  # collector/live.py writes it (analyzers do not import it)


def _col(name: str) -> duckdb.Expression:
    return duckdb.ColumnExpression(name)


def _val(value: object) -> duckdb.Expression:
    return duckdb.ConstantExpression(value)


def _latest_before(events: duckdb.DuckDBPyRelation, replica: str, seen_ns: int,
                   seq: int | None) -> int | None:
    """The newest engine time of ``replica``'s events up to ``seen_ns`` (of batch ``seq`` if given)."""
    cond = (_col("replica") == _val(replica)) & (_col("ts_ns") <= _val(seen_ns))
    if seq is not None:
        cond = cond & (_col("seq") == _val(seq))
    ((latest,),) = events.filter(cond).aggregate("max(ts_ns)").fetchall()
    return None if latest is None else int(latest)


def _labels(value: object) -> dict[str, str]:
    """A MAP as DuckDB's Python client returns it: a dict, or {'key': [...], 'value': [...]}."""
    if isinstance(value, dict) and set(value) == {"key", "value"}:
        return dict(zip(value["key"], value["value"], strict=True))
    return dict(value) if isinstance(value, dict) else {}


def event_gaps(*, metric_samples: duckdb.DuckDBPyRelation,
               kv_events: duckdb.DuckDBPyRelation) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(gaps: replica, seen_ns, batches, start_ns; clears: replica, ts_ns) of a scenario's rows.

    Gap rows are few (one per unfillable gap), so each looks up its start on its own.
    """
    rows = (metric_samples.filter((_col("name") == _val(GAP_METRIC)) & _col("replica").isnotnull())
            .select("replica", "ts_ns", "value", "labels").fetchall())
    gaps = []
    for replica, seen_ns, batches, labels in rows:
        first = _labels(labels).get("from_seq", "")
        before = int(first) - 1 if first.isdigit() else None
        start = (_latest_before(kv_events, replica, seen_ns, before) if before is not None else None) \
            or _latest_before(kv_events, replica, seen_ns, None) or seen_ns
        gaps.append({"replica": replica, "seen_ns": seen_ns, "batches": batches, "start_ns": start})
    schema = {"replica": pl.String, "seen_ns": pl.Int64, "batches": pl.Float64, "start_ns": pl.Int64}
    clears = pl.DataFrame(schema={"replica": pl.String, "ts_ns": pl.Int64})
    if gaps:
        cleared = kv_events.filter((_col("kind") == _val("cleared")) & _col("replica").isnotnull())
        rows = cleared.select("replica", "ts_ns").fetchall()
        clears = pl.DataFrame(rows, schema=clears.schema, orient="row")
    return pl.DataFrame(gaps, schema=schema), clears


def mark_incomplete(request_ledger: pl.DataFrame, gaps: pl.DataFrame, clears: pl.DataFrame) -> pl.DataFrame:
    """``request_ledger`` with ``events_incomplete`` (module docstring), its rows in their order."""
    if gaps.is_empty():
        return request_ledger.with_columns(events_incomplete=pl.lit(False))
    # No clear in (start, arrival]: the replica's first clear after the gap's start, if any, is
    # after the arrival.
    known = (gaps.select("replica", "start_ns").unique().join(clears, on="replica", how="left")
             .group_by("replica", "start_ns")
             .agg(known_ns=pl.col("ts_ns").filter(pl.col("ts_ns") > pl.col("start_ns")).min()))
    after = (pl.col("start_ns") <= pl.col("arrival_ns")) & \
        (pl.col("known_ns").is_null() | (pl.col("known_ns") > pl.col("arrival_ns")))
    flags = (request_ledger.select("request_id", "replica", "arrival_ns").join(known, on="replica")
             .group_by("request_id").agg(incomplete=after.any()))
    return (request_ledger.join(flags, on="request_id", how="left", maintain_order="left")
            .with_columns(events_incomplete=pl.col("incomplete").fill_null(False)).drop("incomplete"))
