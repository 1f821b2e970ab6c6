"""The spine's read-only SQL: lake views and the analysis DB behind one DuckDB connection.

Only statements that read (SELECT, EXPLAIN, DESCRIBE, SHOW, SUMMARIZE) are run: a query that
writes is refused before DuckDB sees it. Rendering is pure: rows in, text out.
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

from kvlens.errors import ConfigError, KvlensError, ReadOnlyError
from kvlens.lake import open_lake

__all__ = ["connect", "query", "render", "run_readonly"]

_READ_STATEMENTS = {"SELECT", "EXPLAIN"}


def connect(lake: str | Path | None = None, db: str | Path | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory connection with the analysis DB attached read-only and lake views on top."""
    if lake is None and db is None:
        raise ConfigError("nothing to query: pass --lake DIR, --db FILE, or both")
    con = duckdb.connect(":memory:")
    if db is not None:
        path = Path(db)
        if not path.is_file():
            raise ConfigError(f"analysis DB {path} does not exist: run kvlens analyze --db {path} first")
        con.execute(f"ATTACH '{str(path.resolve()).replace(chr(39), chr(39) * 2)}' AS analysis (READ_ONLY)")
        con.execute("SET search_path = 'memory.main,analysis.main'")
    if lake is not None:
        open_lake(con, lake)
    return con


def run_readonly(con: duckdb.DuckDBPyConnection, query: str,
                 params: Sequence[Any] | None = None) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run one reading statement; returns (column names, rows)."""
    try:
        statements = con.extract_statements(query)
    except duckdb.Error as e:
        raise KvlensError(f"query does not parse: {str(e).splitlines()[0]}") from None
    if len(statements) != 1:
        raise ConfigError(f"expected exactly one statement, got {len(statements)}")
    kind = statements[0].type.name
    # EXPLAIN ANALYZE runs the statement it explains, so it is refused outright.
    if kind == "EXPLAIN" and query.lstrip().lower().split()[:2] == ["explain", "analyze"]:
        kind = "EXPLAIN ANALYZE"
    if kind not in _READ_STATEMENTS:
        raise ReadOnlyError(f"kvlens sql is read-only: a {kind} statement is refused; "
                            "query with SELECT, or write through kvlens commands")
    try:
        cur = con.execute(query, params or [])
        rows = cur.fetchall()
    except duckdb.Error as e:
        raise KvlensError(f"query failed: {str(e).splitlines()[0]}") from None
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
