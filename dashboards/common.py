"""Dashboards: what every Streamlit page shares: the read-only connection and the sidebar filters.

One DuckDB connection per database file for the whole server (``st.cache_resource``, the file
attached read-only), one cursor per rerun; the sidebar's scenario and time-window selectors become
the scenario and the half-open ``Window`` (dashboards/read.py) that every query binds as parameters.
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import altair as alt
import duckdb
import polars as pl
import streamlit as st

from kvlens.dashboards.formatting import fmt_bytes as _fmt_bytes
from kvlens.dashboards.provenance import Origin, bytes_sentence, origins
from kvlens.dashboards.queries import scenario_span_ns, scenarios
from kvlens.dashboards.read import Window, has_rows
from kvlens.query import connect

__all__ = [
    "Context",
    "connection",
    "cursor",
    "empty",
    "fmt_bytes",
    "fmt_ratio",
    "label",
    "no_rows",
    "origin",
    "page_header",
    "show_chart",
    "sidebar",
    "windowed",
]

_MINUTE_NS = 60 * 10**9


@dataclass(frozen=True)
class Context:
    """What a page renders from: this rerun's cursor, the filters, the scenario list."""

    cur: duckdb.DuckDBPyConnection
    scenario: str
    window: Window
    scenarios: tuple[str, ...]
    db: str


@st.cache_resource(show_spinner=False, max_entries=4)
def _open(db: str, stamp: tuple[int, int]) -> duckdb.DuckDBPyConnection:
    # The file is ATTACHed read-only to an in-memory database (kvlens.query.connect): a plain
    # duckdb.connect(path) would hand back DuckDB's cached instance of the replaced file.
    return connect(db=db)


def connection(db: str) -> duckdb.DuckDBPyConnection:
    """The server's one read-only connection to ``db`` (pages take a cursor from it per rerun).

    Keyed by the file's inode and mtime as well: ``kvlens analyze`` renames a new DB into place,
    and the next rerun opens that one instead of showing the old file forever.
    """
    st_ = os.stat(db)
    return _open(db, (st_.st_ino, st_.st_mtime_ns))


def cursor(db: str) -> duckdb.DuckDBPyConnection:
    """This rerun's cursor on the shared connection, reading the analysis DB and nothing else."""
    cur = connection(db).cursor()
    # A cursor is a new DuckDB session: USE does not carry over. The lock does (kvlens.query.connect
    # opens the database with external access off, Python replacement scans off, settings locked).
    cur.execute("USE analysis")
    return cur


def _ns_to_dt(ns: int) -> dt.datetime:
    return dt.datetime(1970, 1, 1) + dt.timedelta(microseconds=ns // 1000)


def _dt_to_ns(value: dt.datetime) -> int:
    return (value - dt.datetime(1970, 1, 1)) // dt.timedelta(microseconds=1) * 1000


def _window_slider(cur: duckdb.DuckDBPyConnection, scenario: str) -> Window:
    span = scenario_span_ns(cur, scenario)
    if span is None:
        st.sidebar.caption("no requests in this scenario: no time window")
        return Window()
    lo_ns = span[0] // _MINUTE_NS * _MINUTE_NS
    hi_ns = (span[1] // _MINUTE_NS + 1) * _MINUTE_NS
    lo, hi = _ns_to_dt(lo_ns), _ns_to_dt(hi_ns)
    start, end = st.sidebar.slider(
        "Time window (UTC)",
        min_value=lo,
        max_value=hi,
        value=(lo, hi),
        step=dt.timedelta(minutes=1),
        format="MM-DD HH:mm",
        key=f"window:{scenario}",
    )
    if (start, end) == (lo, hi):
        return Window()
    return Window(_dt_to_ns(start), _dt_to_ns(end))


def sidebar(cur: duckdb.DuckDBPyConnection, db: str) -> Context:
    """Draw the scenario and time-window selectors; the filters they set."""
    names = tuple(scenarios(cur)["scenario"].to_list())
    st.sidebar.caption(f"analysis DB: `{db}`")
    if not names:
        st.sidebar.warning("no analyzed scenarios")
        return Context(cur, "", Window(), names, db)
    scenario = st.sidebar.selectbox("Scenario", names, key="scenario")
    return Context(cur, scenario, _window_slider(cur, scenario), names, db)


def origin(ctx: Context, scenario: str | None = None) -> Origin:
    """What the selected (or the named) scenario's figures rest on (table ``scenarios``)."""
    name = scenario or ctx.scenario
    return origins(ctx.cur, [name])[name]


def label(text: str, found: Origin) -> str:
    """A metric's label with ``(modelled)`` / ``(measured)`` beside it, when that is recorded."""
    return f"{text} ({found.label})" if found.label else text


def page_header(ctx: Context, title: str) -> None:
    """A scenario page's header, ``title: scenario``, and under it what its figures are: modelled, on
    what, and a KV geometry that was assumed."""
    st.header(f"{title}: {ctx.scenario}")
    found = origin(ctx)
    if found.label == "modelled":
        st.caption(f"Modelled, not measured: `{ctx.scenario}` is a simulated what-if ({found.assumptions}).")
    if found.assumed_bytes:
        st.warning(bytes_sentence({found.scenario: found}) or "KV bytes assume the default geometry",
                   icon=":material/warning:")


def empty(ctx: Context, table: str, how: str | None = None) -> bool:
    """Whether ``table`` has no rows for the selected scenario; the page then says so (``no_rows``)."""
    if has_rows(ctx.cur, table, ctx.scenario):
        return False
    no_rows(ctx, table, how)
    return True


def windowed(ctx: Context, table: str, read: Callable[[duckdb.DuckDBPyConnection, str, Window], pl.DataFrame],
             nothing: str) -> pl.DataFrame | None:
    """``read`` for the selected scenario and window; None, said on the page, when ``table`` has no rows
    for the scenario or none falls in the window (``nothing``: what the page then says is missing)."""
    if empty(ctx, table):
        return None
    frame = read(ctx.cur, ctx.scenario, ctx.window)
    if frame.height == 0:
        st.info(f"{nothing} in this time window")
        return None
    return frame


def no_rows(ctx: Context, table: str, how: str | None = None) -> None:
    """Say plainly that an analysis has nothing to show yet, and how to get it."""
    how = how or f"run kvlens analyze --lake LAKE --db {ctx.db}"
    st.info(f"`{table}`: no rows yet for scenario `{ctx.scenario}`: {how}", icon=":material/info:")


def show_chart(chart: alt.Chart | alt.LayerChart) -> None:
    st.altair_chart(chart, width="stretch")


def fmt_bytes(n: Any) -> str:
    """Sizes on the dashboard's metrics: one decimal (the report's sentences carry two)."""
    return _fmt_bytes(n, digits=1)


def fmt_ratio(r: Any) -> str:
    return "n/a" if r is None else f"{r:.1%}"
