"""Dashboards: the flows page: bytes read, written and copied per window, and fan-out."""

from __future__ import annotations

import polars as pl
import streamlit as st

from kvlens.dashboards import analyses, charts
from kvlens.dashboards.common import (
    Context,
    fmt_bytes,
    fmt_ratio,
    page_header,
    show_chart,
    windowed,
)

__all__ = ["flows"]


_WORST_WINDOW = "15m"


def _flow_metrics(frame: pl.DataFrame, long: pl.DataFrame) -> None:
    written = frame["write_bytes"].sum() or 0
    never = frame["never_read_bytes"].sum() or 0
    moved = long.filter(pl.col("flow") != "never_read").sort("window")
    worst = (
        moved.group_by_dynamic("window", every=_WORST_WINDOW)
        .agg(pl.col("bytes").sum())
        .sort("bytes", descending=True)
        .head(1)
    )
    a, b, c, d = st.columns(4)
    a.metric("Read", fmt_bytes(frame["read_bytes"].sum()))
    b.metric("Written", fmt_bytes(written))
    c.metric(
        "Never read again",
        fmt_ratio(float(never) / float(written) if written else None),
        help=f"{fmt_bytes(never)} written and removed without a read",
    )
    if worst.height:
        d.metric(
            "Worst 15-minute window", fmt_bytes(worst["bytes"][0]), help=f"from {worst['window'][0]:%H:%M}"
        )


def flows(ctx: Context) -> None:
    """Bytes read, written and copied between replicas per window; never-read bytes."""
    page_header(ctx, "Flows")
    frame = windowed(ctx, "flows", analyses.flows, "no flows")
    if frame is None:
        return
    long = analyses.flows_long(frame)
    _flow_metrics(frame, long)
    show_chart(charts.flows_chart(long))
    st.subheader("Per tier and replica")
    per = (
        frame.group_by("tier", "replica")
        .agg(pl.col("read_bytes", "write_bytes", "replica_bytes", "never_read_bytes").sum())
        .sort("tier", "replica")
    )
    st.dataframe(per, hide_index=True)
    _fanout(ctx)


def _fanout(ctx: Context) -> None:
    st.subheader("Fan-out")
    frame = windowed(ctx, "fanout", analyses.fanout, "no fan-out windows")
    if frame is None:
        return
    show_chart(charts.fanout_chart(frame))
    st.dataframe(frame, hide_index=True)
