"""Dashboards: the misses page: from an outcome to the replicas, the requests and the blocks behind it."""

from __future__ import annotations

import polars as pl
import streamlit as st

from kvlens.dashboards import analyses, charts
from kvlens.dashboards.common import (
    Context,
    empty,
    page_header,
    show_chart,
)
from kvlens.dashboards.queries import (
    ledger_by_outcome,
)
from kvlens.schema import HIT_OUTCOMES

__all__ = ["misses"]


def misses(ctx: Context) -> None:
    """Drill from an outcome to the replicas, to the requests, to the blocks behind it."""
    page_header(ctx, "Misses")
    if empty(ctx, "block_outcomes"):
        return
    totals = analyses.outcome_totals(ledger_by_outcome(ctx.cur, ctx.scenario, ctx.window))
    misses_only = totals.filter(~pl.col("outcome").is_in(HIT_OUTCOMES) & (pl.col("tokens") > 0))
    if misses_only.height == 0:
        st.success("no missed blocks in this window")
        return
    st.dataframe(
        misses_only,
        hide_index=True,
        column_config={"share": st.column_config.NumberColumn("share of tokens", format="percent")},
    )
    outcome = st.selectbox("Outcome", misses_only["outcome"].to_list(), key="miss_outcome")
    replicas = analyses.outcome_replicas(ctx.cur, ctx.scenario, ctx.window, outcome)
    show_chart(charts.replica_bar_chart(replicas, title=f"Which replicas had the {outcome} tokens?"))
    if replicas.height == 0:
        return
    replica = st.selectbox("Replica", replicas["replica"].to_list(), key="miss_replica")
    requests = analyses.outcome_requests(ctx.cur, ctx.scenario, ctx.window, outcome, replica)
    st.subheader(f"Requests on {replica} with {outcome} blocks (top {requests.height} by tokens)")
    st.dataframe(requests, hide_index=True)
    if requests.height == 0:
        return
    request_id = st.selectbox("Request", requests["request_id"].to_list(), key="miss_request")
    st.subheader(f"Blocks of {request_id}")
    st.dataframe(analyses.request_blocks(ctx.cur, ctx.scenario, request_id), hide_index=True)
