"""Dashboards: the overview page: the report's first screen (what happened, why, what to do), then the
selected range's hit ratios, ledger by outcome, trend and engine counters."""

from __future__ import annotations

import os

import streamlit as st

from kvlens.dashboards import analyses, charts
from kvlens.dashboards.common import (
    Context,
    empty,
    fmt_bytes,
    fmt_ratio,
    label,
    origin,
    page_header,
    show_chart,
)
from kvlens.dashboards.decisions import Decisions, decide
from kvlens.dashboards.formatting import fmt_int, fmt_pct, fmt_points
from kvlens.dashboards.provenance import origins
from kvlens.dashboards.queries import (
    headlines,
    hit_ratios,
    ledger_by_outcome,
    pick_bucket_ns,
    reconciliation,
    scenario_span_ns,
    trend,
)
from kvlens.dashboards.read import Window, has_rows
from kvlens.dashboards.report.lead import change_sentence

__all__ = ["PRICE_ENV", "decision", "decision_window", "overview"]


PRICE_ENV = "KVLENS_GPU_HOUR_USD"  # set by kvlens dashboard --gpu-hour-price


DAY_NS = 86_400 * 10**9


PAGE_TITLES = {"whatif": "What-if", "prefixes": "Prefixes", "capacity": "Capacity", "hygiene": "Hygiene",
               "misses": "Misses"}


def decision_window(ctx: Context) -> tuple[Window, str] | None:
    """The half-open window the first part describes, and how it was chosen, in words."""
    if not ctx.window.whole:
        return ctx.window, "the selected window against the one before it"
    span = scenario_span_ns(ctx.cur, ctx.scenario)
    if span is None:
        return None
    first, end = span[0], span[1] + 1  # just after the latest arrival, as the report's window ends
    if end - first >= 2 * DAY_NS:
        return Window(end - DAY_NS, end), "the last 24 hours against the 24 before"
    half = max((end - first + 1) // 2, 1)  # rounded up: the window before starts at or before the first
    return Window(end - half, end), ("the later half of the scenario (it spans under two days) against the "
                                     "earlier")


def _price() -> float | None:
    raw = os.environ.get(PRICE_ENV)
    try:
        return None if not raw else max(float(raw), 0.0)
    except ValueError:
        return None


def _metrics(d: Decisions) -> None:
    label = d.origin.label or "not recorded"
    prev = d.previous
    a, b, c, e = st.columns(4)

    def delta(now: float | None, before: float | None) -> str | None:
        return None if now is None or before is None else fmt_points((now - before) * 100)

    a.metric(f"Token hit ratio, this window ({label})", fmt_pct(d.current.token_hit_ratio),
             delta(d.current.token_hit_ratio, prev.token_hit_ratio if prev else None))
    b.metric(f"Byte hit ratio, this window ({label})", fmt_pct(d.current.byte_hit_ratio),
             delta(d.current.byte_hit_ratio, prev.byte_hit_ratio if prev else None))
    c.metric("Avoidable recomputed tokens", fmt_int(d.avoidable_tokens),
             help="every miss but miss_cold, in this window")
    e.metric(f"Their worth ({d.price.label or 'n/a'})", d.price.amount(d.avoidable_tokens),
             help=f"{d.price.assumptions}; {d.price.amount(d.avoidable_tokens * d.per_day)} a day at "
                  "this rate")


def decision(ctx: Context) -> Decisions | None:
    """Draw the first part for the selected scenario; the Decisions drawn (None: nothing to show)."""
    chosen = decision_window(ctx)
    if chosen is None:
        return None
    window, how = chosen
    heads = headlines(ctx.cur, list(ctx.scenarios), window)
    if ctx.scenario not in heads or heads[ctx.scenario].token_hit_ratio is None:
        st.info(f"{ctx.scenario} has no hit ratio in {window.label()}: nothing to decide on")
        return None
    d = decide(ctx.cur, heads, origins(ctx.cur, sorted(heads)), window, usd_per_gpu_hour=_price(),
               production=ctx.scenario)
    if d is None:
        return None
    st.subheader("What happened, and what to do first")
    st.caption(f"{window.label()}: {how}.")
    _metrics(d)
    st.markdown(change_sentence(d))
    if not d.actions:
        st.markdown("No action with a predicted gain was found for this window.")
    for i, act in enumerate(d.actions, 1):
        page = PAGE_TITLES.get(act.page, act.page)
        st.markdown(f"{i}. **{act.title}**: {act.effect} ({act.basis}). [Evidence: {page} page]({act.page})")
    if _price() is None:
        st.caption("Money needs a price: start with kvlens dashboard --gpu-hour-price USD.")
    return d


def _headline(ctx: Context) -> None:
    ratios = hit_ratios(ctx.cur, ctx.scenario, ctx.window)
    tails = has_rows(ctx.cur, "latency_tails", ctx.scenario)
    worst = analyses.worst_tail(ctx.cur, ctx.scenario, ctx.window) if tails else {}
    found = origin(ctx)
    per_token = found.kv_bytes_per_token
    geometry = f"{found.model}, {per_token:,} B/token" if per_token else "unrecorded"
    a, b, c, d = st.columns(4)
    a.metric("Requests", f"{ratios.get('requests') or 0:,}")
    b.metric(
        label("Token hit ratio", found),
        fmt_ratio(ratios.get("token_hit_ratio")),
        help="hit tokens over every prompt token (partial tails included)",
    )
    c.metric(
        label("Byte hit ratio", found),
        fmt_ratio(ratios.get("byte_hit_ratio")),
        help=f"hit KV bytes over {fmt_bytes(ratios.get('prompt_bytes'))} of prompt KV ({geometry}, "
        f"{found.model_source or 'source unrecorded'})",
    )
    if ratios.get("unobserved_tokens"):
        prompt = ratios.get("prompt_tokens") or 0
        unobserved = ratios["unobserved_tokens"] / prompt if prompt else None
        reusable = (ratios.get("reusable_tokens") or 0) / prompt if prompt else None
        st.info(f"{fmt_ratio(unobserved)} of prompt tokens ran on replicas that published no KV events "
                "(outcome unobserved): whether they were cached is unknown. An unbounded cache could have "
                f"served {fmt_ratio(reusable)} of all prompt tokens (modelled: every full block an earlier "
                "request needed).")
    if ratios.get("incomplete_requests"):
        st.warning(f"Incomplete: {ratios['incomplete_requests']:,} of {ratios['requests']:,} requests "
                   "arrived after the collector lost KV-event batches of their replica that the engine's "
                   "replay no longer held (measured: kvlens_collector_gap_batches); their outcomes, and the "
                   "ratios above, may be off until that replica's cache was cleared.")
    if worst:
        where = f"{worst['replica']}, " + (
            "whole scenario" if worst["window"] is None else f"{worst['window']:%H:%M}"
        )
        d.metric(found.ttft("Worst TTFT P99/P50"), f"{worst['p99_p50_ratio']:.1f}x",
                 help=f"{where}; flagged above 5")
    else:
        d.metric("Worst TTFT P99/P50", "n/a", help="latency_tails has no rows yet for this scenario")


def overview(ctx: Context) -> None:
    """Hit ratios, the ledger by outcome per replica, the trend over time, the worst tail."""
    page_header(ctx, "Overview")
    if empty(ctx, "miss_ledger"):
        return
    decision(ctx)  # the report's first screen, in its order; the whole selected range follows
    st.subheader("The selected range")
    _headline(ctx)
    ledger = ledger_by_outcome(ctx.cur, ctx.scenario, ctx.window)
    show_chart(charts.ledger_chart(ledger))
    span = scenario_span_ns(ctx.cur, ctx.scenario)
    if span is not None:
        lo = ctx.window.start_ns if ctx.window.start_ns is not None else span[0]
        hi = ctx.window.end_ns - 1 if ctx.window.end_ns is not None else span[1]  # the last ns in it
        bucket_ns = pick_bucket_ns(max(hi - lo, 1))
        show_chart(
            charts.hit_ratio_trend_chart(
                trend(ctx.cur, ctx.scenario, ctx.window, bucket_ns),
                title=f"How did the token hit ratio move ({bucket_ns // 60_000_000_000} min buckets)?",
            )
        )
    st.subheader("Ledger by outcome")
    st.dataframe(
        analyses.outcome_totals(ledger),
        hide_index=True,
        column_config={"share": st.column_config.NumberColumn(format="percent")},
    )
    empty(ctx, "latency_tails")  # says so when it is
    if has_rows(ctx.cur, "reconciliation", ctx.scenario):  # only where the engines' /metrics were scraped
        _reconciliation(ctx)


def _reconciliation(ctx: Context) -> None:
    """The engines' own prefix-cache hit counters beside the ledger (kvlens analyze --metrics-from)."""
    st.subheader("Engine counters against the ledger")
    st.caption("Increase of the engines' prefix-cache hit counters (local + external) over the scraped "
               "span, beside the ledger's hit tokens and the per-request cached tokens the engines "
               "reported; whole scenario.")
    frame = reconciliation(ctx.cur, ctx.scenario)
    show_chart(charts.reconciliation_chart(frame))
    st.dataframe(frame, hide_index=True,
                 column_config={"difference_ratio": st.column_config.NumberColumn(format="percent")})
