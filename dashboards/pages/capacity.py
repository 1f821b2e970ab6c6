"""Dashboards: the capacity page: miss-ratio curves, C_eff, TTL coverage and warm-up."""

from __future__ import annotations

import polars as pl
import streamlit as st

from kvlens.dashboards import analyses, charts
from kvlens.dashboards.common import (
    Context,
    empty,
    fmt_bytes,
    fmt_ratio,
    no_rows,
    page_header,
    show_chart,
)

__all__ = ["capacity"]


def _capacity_metrics(marks: pl.DataFrame) -> None:
    row = marks.row(0, named=True)
    terms = ("c_active_decode_bytes", "c_reserved_bytes", "c_fragmentation_bytes")
    subtracted = sum(row[c] or 0 for c in terms)
    a, b, c, d = st.columns(4)
    a.metric("C_physical", fmt_bytes(row["c_physical_bytes"]),
             help="configured: kvlens analyze --cache-tokens")
    if subtracted:
        b.metric("C_eff", fmt_bytes(row["c_eff_bytes"]), help=f"active decode from {row['active_source']}")
    else:
        b.metric("C_eff (nothing subtracted)", fmt_bytes(row["c_eff_bytes"]),
                 help="no decode, reserve or fragmentation was measured: C_eff = C_physical")
    c.metric("Byte hit ratio at C_eff (modelled LRU)", fmt_ratio(row["hit_ratio_bytes_at_eff"]),
             help="an LRU of full-block slots on the exact curve, over the full blocks' bytes")
    d.metric("Gain from 2 x C_eff (modelled LRU)", fmt_ratio(row["gain_from_2x_ratio"]))
    parts = pl.DataFrame(
        {
            "term": ["C_physical", "- C_active_decode", "- C_reserved", "- C_fragmentation", "= C_eff"],
            "bytes": [
                row["c_physical_bytes"],
                row["c_active_decode_bytes"],
                row["c_reserved_bytes"],
                row["c_fragmentation_bytes"],
                row["c_eff_bytes"],
            ],
        }
    ).with_columns(pl.col("bytes").map_elements(fmt_bytes, return_dtype=pl.String).alias("size"))
    st.dataframe(parts, hide_index=True)


def capacity(ctx: Context) -> None:
    """Exact and sampled LRU curves with the fleet's effective capacity marked; TTL; warm-up."""
    page_header(ctx, "Capacity")
    st.caption("Curves and capacity cover the whole scenario: the time window does not apply here. The "
               "curves are modelled: an LRU of full-block slots replayed over the scenario's full blocks; "
               "their ratios are of those blocks (partial tails are never cached).")
    if empty(ctx, "mrc"):
        return
    streams = analyses.mrc_streams(ctx.cur, ctx.scenario)
    stream = st.selectbox("Stream", streams, key="mrc_stream") if len(streams) > 1 else streams[0]
    marks = analyses.capacity_marks(ctx.cur, ctx.scenario)
    if marks.height:
        _capacity_metrics(marks)
    else:
        no_rows(ctx, "capacity", f"run kvlens analyze --cache-tokens N --db {ctx.db}")
    show_chart(charts.mrc_chart(analyses.mrc_curve(ctx.cur, ctx.scenario, stream), marks))
    st.subheader("TTL coverage")
    ttl = analyses.ttl_coverage(ctx.cur, ctx.scenario)
    if ttl.height:
        show_chart(charts.ttl_chart(ttl))
        st.dataframe(ttl.drop("scenario"), hide_index=True)
    else:
        no_rows(ctx, "ttl_coverage")
    st.subheader("Warm-up")
    warm = analyses.warmup(ctx.cur, ctx.scenario)
    if warm.height:
        st.dataframe(warm, hide_index=True)
    else:
        no_rows(ctx, "warmup")
