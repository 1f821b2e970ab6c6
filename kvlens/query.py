"""The spine's read-only SQL: lake views and the analysis DB behind one locked DuckDB connection.

Only statements that read (SELECT, DESCRIBE, SHOW, SUMMARIZE, and EXPLAIN of those) are run, as
DuckDB itself parses them (kvlens/readonly.py); the connection can read nothing but the lake's
tables and the analysis DB, and its configuration is locked. Rendering is pure: rows in, text out.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import duckdb

from kvlens.analysis_db import attach_analysis_db
from kvlens.errors import ConfigError, KvlensError, ReadOnlyError
from kvlens.lake import open_lake
from kvlens.readonly import lake_view_dirs, lock_down, refusal, sandbox_config
from kvlens.schema import LAKE_TABLES

__all__ = ["connect", "query", "render", "run_readonly"]


def connect(lake: str | Path | None = None, db: str | Path | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory connection with the analysis DB attached read-only and lake views on top,
    locked so that it reads those files and nothing else (kvlens/readonly.py)."""
    if lake is None and db is None:
        raise ConfigError("nothing to query: pass --lake DIR, --db FILE, or both")
    con = duckdb.connect(":memory:", config=sandbox_config())
    try:
        readable = []
        if db is not None:
            attach_analysis_db(con, db, "analysis")
            con.execute("SET search_path = 'memory.main,analysis.main'")
            readable += lake_view_dirs(con, "analysis")
        if lake is not None:
            open_lake(con, lake)
            readable += [Path(lake) / t.name for t in LAKE_TABLES]
        lock_down(con, readable)
    except BaseException:
        con.close()
        raise
    return con


def run_readonly(con: duckdb.DuckDBPyConnection, query: str,
                 params: Sequence[Any] | None = None) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run one reading statement; returns (column names, rows)."""
    kind = refusal(con, query)
    if kind is not None:
        raise ReadOnlyError(f"kvlens sql is read-only and refuses this {kind} statement: "
                            "query with SELECT, or write through kvlens commands")
    try:
        cur = con.execute(query, params or [])
        rows = cur.fetchall()
    except duckdb.PermissionException as e:
        raise ReadOnlyError(f"kvlens sql reads only the lake's tables and the analysis DB: "
                            f"{str(e).splitlines()[0]}") from None
    except duckdb.Error as e:
        first = str(e).splitlines()[0]
        hint = (": a lake segment is damaged; move the file it names out of the lake and rerun"
                if ".parquet" in first and "Failed to read" in first else "")
        raise KvlensError(f"query failed: {first}{hint}") from None
    return [d[0] for d in cur.description or []], rows


def query(sql: str, *, lake: str | Path | None = None, db: str | Path | None = None,
          params: Sequence[Any] | None = None) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Open, run one reading statement, close: (column names, rows)."""
    con = connect(lake=lake, db=db)
    try:
        return run_readonly(con, sql, params)
    finally:
        con.close()


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else str(value)
    return str(value)


def _json_value(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict | list | tuple):
        return json.loads(json.dumps(value, default=str))
    return str(value)


def render(columns: list[str], rows: list[tuple[Any, ...]], fmt: str = "table") -> str:
    """Rows as an aligned table, CSV (a header line and the rows, nothing else) or JSON."""
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(columns)
        w.writerows([[_cell(v) for v in r] for r in rows])
        return buf.getvalue()
    if fmt == "json":
        return json.dumps([{c: _json_value(v) for c, v in zip(columns, r, strict=True)} for r in rows],
                          indent=1) + "\n"
    if fmt != "table":
        raise ConfigError(f"unknown format {fmt!r}: choose table, csv or json")
    cells = [columns, *[[_cell(v) for v in r] for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(lines) + "\n"
