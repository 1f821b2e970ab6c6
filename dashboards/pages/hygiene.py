"""Dashboards: the hygiene page: prompt divergences that split shared chains."""

from __future__ import annotations

import streamlit as st

from kvlens.dashboards import analyses, charts
from kvlens.dashboards.common import Context, fmt_bytes, page_header, show_chart, windowed

__all__ = ["hygiene"]


def hygiene(ctx: Context) -> None:
    """Requests whose chains split early before repeated content: tokens lost, where, who."""
    page_header(ctx, "Hygiene")
    by_split = windowed(ctx, "hygiene", analyses.hygiene_by_split, "no hygiene findings")
    if by_split is None:
        return
    a, b, c = st.columns(3)
    a.metric("Requests affected", f"{by_split['requests'].sum():,}")
    b.metric("Tokens lost", f"{by_split['lost_tokens'].sum():,}")
    c.metric("KV lost", fmt_bytes(by_split["lost_bytes"].sum()))
    show_chart(charts.hygiene_chart(by_split))
    groups = analyses.hygiene_offenders(ctx.cur, ctx.scenario, ctx.window)
    if groups is not None and groups.height:
        st.subheader("Offender groups (same repeated content after the same prefix)")
        st.dataframe(groups, hide_index=True)
    st.subheader("Top requests by tokens lost")
    st.dataframe(analyses.hygiene_requests(ctx.cur, ctx.scenario, ctx.window), hide_index=True)
