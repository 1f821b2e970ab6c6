"""Dashboards: the prefixes page: the publish ranking in words."""

from __future__ import annotations

import streamlit as st

from kvlens.dashboards import analyses, charts
from kvlens.dashboards.common import Context, empty, page_header, show_chart

__all__ = ["prefixes"]


_TOP_PREFIXES = 20


def prefixes(ctx: Context) -> None:
    """Prefix groups ranked by the expected benefit of publishing them, with the reasons."""
    page_header(ctx, "Prefixes")
    st.caption("The ranking covers the whole scenario: the time window does not apply here.")
    if empty(ctx, "prefix_ranking"):
        return
    ranking = analyses.prefix_ranking(ctx.cur, ctx.scenario)
    counts = ranking.group_by("recommendation").len().sort("len", descending=True)
    for col, row in zip(st.columns(max(counts.height, 1)), counts.iter_rows(named=True), strict=False):
        col.metric(str(row["recommendation"]), f"{row['len']:,}")
    show_chart(
        charts.prefix_benefit_chart(
            ranking.head(_TOP_PREFIXES), title=f"Which {_TOP_PREFIXES} prefixes are worth publishing most?"
        )
    )
    st.dataframe(ranking, hide_index=True)
