"""The spine's analysis DB writer: result frames -> a new DuckDB file, renamed into place.

The file holds the analysis tables (typed as kvlens/schema.py declares them), the schema's
ENUM types, and views over the lake by absolute path, so ``duckdb kvlens.duckdb`` answers
SQL over raw and derived data alike. Readers never see a half-built file: it is written
under a temporary name and renamed over the old one.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

import duckdb
import polars as pl

from kvlens.lake import create_enum_types, open_lake
from kvlens.schema import ANALYSIS_TABLES, SCHEMA_VERSION, TABLES

__all__ = ["build_analysis_db"]

Compute = Callable[[duckdb.DuckDBPyConnection], Iterable[tuple[str, pl.DataFrame]]]


def _create_tables(con: duckdb.DuckDBPyConnection) -> None:
    for table in ANALYSIS_TABLES:
        cols = ", ".join(f"{c.name} {c.type}" for c in table.columns)
        con.execute(f"CREATE TABLE {table.name} ({cols})")
    con.execute("CREATE TABLE kvlens_meta (key VARCHAR, value VARCHAR)")
    con.execute("INSERT INTO kvlens_meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])


def _insert(con: duckdb.DuckDBPyConnection, name: str, frame: pl.DataFrame) -> None:
    table = TABLES[name]
    missing = [c for c in table.names if c not in frame.columns]
    if missing:
        raise ValueError(f"frame for {name} lacks columns {missing}")
    con.register("_frame", frame.select(table.names))
    cols = ", ".join(f"CAST({c.name} AS {c.type})" for c in table.columns)
    con.execute(f"INSERT INTO {name} SELECT {cols} FROM _frame")
    con.unregister("_frame")


def build_analysis_db(db: str | os.PathLike[str], lake: str | os.PathLike[str], compute: Compute) -> Path:
    """Build the analysis DB at ``db`` from ``lake``; ``compute`` yields (table, frame) pairs."""
    final = Path(db).resolve()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        con = duckdb.connect(str(tmp))
        try:
            create_enum_types(con)
            open_lake(con, lake)
            _create_tables(con)
            for name, frame in compute(con):
                _insert(con, name, frame)
            con.execute("CHECKPOINT")
        finally:
            con.close()
        os.replace(tmp, final)
    finally:
        for leftover in (tmp, tmp.with_name(tmp.name + ".wal")):
            leftover.unlink(missing_ok=True)
    return final
