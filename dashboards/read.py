"""Dashboards: the read layer's core: the analysis DB opened read-only, one time window, bound queries.

Every reader (the Streamlit pages, the report, its findings and actions) takes a ``Window`` of
request arrivals, half-open [start_ns, end_ns) with either bound None for no bound, binds it as
``$start_ns`` / ``$end_ns`` through ``in_window``, and runs its SQL with ``rows`` (tuples) or
``fetch`` (a Polars frame). Nothing from a user is formatted into SQL; only the parameters a
statement names are bound. The SELECTs themselves are constants in ``dashboards/queries.py``,
``dashboards/analyses.py`` and ``dashboards/report_queries.py``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import duckdb
import polars as pl

from kvlens.errors import ConfigError
from kvlens.query import connect

__all__ = [
    "Window",
    "fetch",
    "from_lake_view",
    "has_rows",
    "in_window",
    "open_db",
    "rows",
    "table_columns",
    "table_rows",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Window:
    """Requests arriving in [start_ns, end_ns); a bound of None leaves that side open."""

    start_ns: int | None = None
    end_ns: int | None = None

    @property
    def whole(self) -> bool:
        return self.start_ns is None and self.end_ns is None

    def params(self, **extra: Any) -> dict[str, Any]:
        """The bound values of ``in_window`` (and ``extra``)."""
        return {"start_ns": self.start_ns, "end_ns": self.end_ns, **extra}

    @property
    def length_ns(self) -> int:
        start, end = self.bounds()
        return end - start

    def previous(self) -> Window:
        """The window of the same length that ends where this one starts."""
        start, end = self.bounds()
        return Window(2 * start - end, start)

    def label(self) -> str:
        start, end = self.bounds()
        return f"{_utc(start)} to {_utc(end)}"

    def bounds(self) -> tuple[int, int]:
        """(start_ns, end_ns) of a window bounded on both sides."""
        if self.start_ns is None or self.end_ns is None:
            raise ValueError(f"{self} is open on one side: it has no length, label or previous window")
        return self.start_ns, self.end_ns


def _utc(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


# The casts let NULL bounds type-check.
def in_window(col: str) -> str:
    """SQL predicate: ``col`` in [$start_ns, $end_ns), either bound may be NULL (no bound)."""
    return (
        f"(CAST($start_ns AS BIGINT) IS NULL OR {col} >= $start_ns) AND "
        f"(CAST($end_ns AS BIGINT) IS NULL OR {col} < $end_ns)"
    )


def _used(sql: str, params: dict[str, Any] | None) -> dict[str, Any]:
    # DuckDB refuses a named parameter the statement does not use: a context may carry more.
    return {k: v for k, v in (params or {}).items() if re.search(rf"\${k}\b", sql)}


def rows(cur: duckdb.DuckDBPyConnection, sql: str,
         params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
    """Run one bound query; its rows as tuples."""
    return cur.execute(sql, _used(sql, params)).fetchall()


def fetch(cur: duckdb.DuckDBPyConnection, sql: str, params: dict[str, Any] | None = None) -> pl.DataFrame:
    """Run one bound query; its rows as a Polars frame."""
    return cur.sql(sql, params=_used(sql, params)).pl()


def open_db(db: str | Path) -> duckdb.DuckDBPyConnection:
    """A read-only connection to the analysis DB (never the lake); a one-line error if it is not one."""
    try:
        con = connect(db=db)
    except duckdb.Error as e:
        raise ConfigError(f"cannot open analysis DB {db}: {str(e).splitlines()[0]}: "
                          "pass a file written by kvlens analyze") from None
    if not _is_table(con, "request_ledger"):
        con.close()
        raise ConfigError(f"{db} is not a kvlens analysis DB (no request_ledger table): "
                          "pass a file written by kvlens analyze")
    return con


TABLE_COLUMNS_SQL = """
SELECT column_name FROM information_schema.columns
WHERE table_name = $table AND table_schema = 'main' ORDER BY ordinal_position
"""
# A table, not a view: the analysis DB also holds views over the lake, which may have moved.
IS_TABLE_SQL = "SELECT count(*) FROM duckdb_tables() WHERE schema_name = 'main' AND table_name = $table"


def table_columns(cur: duckdb.DuckDBPyConnection, table: str) -> list[str]:
    """The table's columns; empty when the DB has no such table (an older analysis DB)."""
    return [r[0] for r in rows(cur, TABLE_COLUMNS_SQL, {"table": table})]


def _is_table(cur: duckdb.DuckDBPyConnection, table: str) -> bool:
    ((found,),) = rows(cur, IS_TABLE_SQL, {"table": table})
    return bool(found)


def _scoped(cur: duckdb.DuckDBPyConnection, table: str, scenario: str | None) -> str | None:
    """``FROM table [WHERE scenario = $scenario]``; None when the DB has no such table.

    ``table`` must be a schema name: it is checked against the catalog before it is quoted into
    the statement, because a table name cannot be bound.
    """
    if not _is_table(cur, table):
        return None
    ident = '"' + table.replace('"', '""') + '"'
    if scenario is not None and "scenario" in table_columns(cur, table):
        return f"FROM {ident} WHERE scenario = $scenario"
    return f"FROM {ident}"


def table_rows(cur: duckdb.DuckDBPyConnection, table: str, scenario: str | None = None) -> int | None:
    """Rows of ``table`` (for ``scenario`` when given and the table has that column); None if absent."""
    scoped = _scoped(cur, table, scenario)
    if scoped is None:
        return None
    ((n,),) = rows(cur, f"SELECT count(*) {scoped}", {"scenario": scenario})
    return int(n)


def has_rows(cur: duckdb.DuckDBPyConnection, table: str, scenario: str | None = None) -> bool:
    """Whether ``table`` exists and has a row (for ``scenario`` when given and the table has that column)."""
    scoped = _scoped(cur, table, scenario)
    if scoped is None:
        return False
    # fetchall, not fetchone: a result left open would block the next relation on this connection.
    ((found,),) = rows(cur, f"SELECT EXISTS (SELECT 1 {scoped})", {"scenario": scenario})
    return bool(found)


HAS_VIEW_SQL = """
SELECT count(*) FROM information_schema.tables
WHERE table_catalog = 'analysis' AND table_schema = 'main' AND table_name = $view
"""


def from_lake_view(con: duckdb.DuckDBPyConnection, view: str,
                   read: Callable[[duckdb.DuckDBPyConnection], T]) -> T | None:
    """``read`` over one of the analysis DB's views of the lake; None when the DB has no such view or
    the lake behind it cannot be read (it has moved): the caller then goes without.

    ``read`` gets a cursor of its own, so that a failure does not leave ``con`` mid-result.
    """
    ((found,),) = rows(con, HAS_VIEW_SQL, {"view": view})
    if not found:
        return None
    cur = con.cursor()
    try:
        return read(cur)
    except duckdb.Error as e:
        log.warning("the lake behind view %s is unreadable (%s): read without it", view,
                    str(e).splitlines()[0])
        return None
    finally:
        cur.close()
