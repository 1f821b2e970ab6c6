"""Dashboards: the overview page's first part, in the report's order: what happened, why, what to do.

The same numbers as the report's first screen (dashboards/decisions.py) for the selected scenario:
its hit ratios with the change from the window before, that change by cause, the avoidable
recomputed tokens and their worth, and the actions, each linking to the page with its evidence.
"""

from __future__ import annotations

import os

import streamlit as st

from kvlens.dashboards.common import Context
from kvlens.dashboards.decisions import Decisions, decide
from kvlens.dashboards.formatting import fmt_int, fmt_pct, fmt_points
from kvlens.dashboards.provenance import origins
from kvlens.dashboards.queries import headlines, scenario_span_ns
from kvlens.dashboards.read import Window
from kvlens.dashboards.report_lead import change_sentence

__all__ = ["PRICE_ENV", "decision", "decision_window"]

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
