"""Dashboards: the actions a report proposes for the production scenario, each with its predicted gain.

Where a what-if was run on the same requests, an action's effect is that what-if's, measured on
the requests both share: hit tokens gained, points of hit ratio, GPU-hours a day at the cost
model's price, and the change of TTFT P99 (all modelled, the what-if named). Where none was run,
the action says so and its number comes from the analysis that proposed it: the prefix
ranking's expected benefit, the miss-ratio curve's doubled cache, the hygiene check's lost
tokens. Actions are ranked by GPU-hours (tokens where nothing prices them), largest first.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb

from kvlens.dashboards.formatting import fmt_int, fmt_ms, fmt_points
from kvlens.dashboards.read import Window, from_lake_view, has_rows, rows
from kvlens.dashboards.report_queries import (
    CAPACITY_ACTION_SQL,
    HYGIENE_ACTION_SQL,
    PREFIX_ACTION_SQL,
    SHARED_REQUESTS_SQL,
    SIMULATIONS_SQL,
)
from kvlens.dashboards.worth import Price

__all__ = ["Action", "actions"]


@dataclass(frozen=True)
class Action:
    """What to do, its predicted effect in words, where the evidence is, and what it is worth."""

    title: str
    effect: str
    basis: str  # the what-if behind it, or that none was run and what predicted it instead
    evidence: str  # the report section / dashboard page (url path) that shows why
    page: str
    tokens: float  # predicted recomputed tokens saved in the window
    gpu_hours: float | None
    what_if: str | None = None


_ROUTING_WORDS = {
    "cache_aware": "route by prefix (cache-aware)",
    "prefix_hash": "route by prefix hash",
    "session_affinity": "keep each session on one replica",
    "round_robin": "route round robin",
    "random": "route at random",
    "recorded": "keep the recorded routing",
}


def _simulations(con: duckdb.DuckDBPyConnection, names: list[str]) -> dict[str, tuple]:
    """Per what-if, what it simulated; empty when the lake's view is absent or unreadable."""
    found = from_lake_view(con, "simulations", lambda cur: rows(cur, SIMULATIONS_SQL, {"names": names}))
    return {r[0]: r[1:] for r in found or []}


def _what_if_title(name: str, mine: tuple | None, theirs: tuple | None) -> str:
    """The change a what-if made against the production scenario's own settings, in words."""
    if theirs is None:
        return f"run as what-if {name} does"
    routing, factor, replicas, capacity, blocks, pool = theirs
    said = []
    if mine is None or routing != mine[0]:
        said.append(_ROUTING_WORDS.get(str(routing), f"route {routing}"))
    if factor is not None and (mine is None or factor != mine[1]):
        said.append(f"fall back to the least loaded replica above {factor:g}x the mean load")
    if mine is not None and replicas != mine[2]:
        said.append(f"run {replicas} replicas")
    if mine is not None and (capacity, blocks) != (mine[3], mine[4]):
        said.append("resize the cache as simulated")
    if pool and (mine is None or pool != mine[5]):
        said.append(f"add a shared pool of {fmt_int(pool)} tokens")
    return "; ".join(said) if said else f"run as what-if {name} does"


def _what_if_actions(con: duckdb.DuckDBPyConnection, scenario: str, what_ifs: list[str], window: Window,
                     price: Price, per_day: float) -> list[Action]:
    found = rows(con, SHARED_REQUESTS_SQL, window.params(scenario=scenario, what_ifs=what_ifs))
    sims = _simulations(con, [scenario, *what_ifs])
    out = []
    for name, n, prompt, hit_p, hit_w, p99_p, p99_w in found:
        gain = int(hit_w or 0) - int(hit_p or 0)
        if gain <= 0 or not prompt:
            continue
        hours = price.gpu_hours(gain)
        effect = f"{fmt_points(gain / prompt * 100)} of hit ratio, {fmt_int(gain)} fewer tokens recomputed"
        if hours is not None:
            effect += f", -{price.amount(gain * per_day)}/day"
        if p99_p is not None and p99_w is not None:
            effect += f", TTFT P99 {'-' if p99_w < p99_p else '+'}{fmt_ms(abs(p99_w - p99_p))}"
        title = _what_if_title(name, sims.get(scenario), sims.get(name))
        out.append(Action(title[:1].upper() + title[1:], effect,
                          f"modelled, what-if {name}, on the {n:,} requests both ran",
                          "Every scenario, Ledger by outcome", "whatif", gain, hours, name))
    return out


def _prefix_action(con: duckdb.DuckDBPyConnection, scenario: str, price: Price) -> list[Action]:
    if not has_rows(con, "prefix_ranking"):
        return []
    found = rows(con, PREFIX_ACTION_SQL, {"scenario": scenario})
    out = []
    for h, tokens, reuses, reps, ms, rec, label, saved in found:
        hours = price.gpu_hours_of_ms(ms)
        what = str(rec)[:1].upper() + str(rec)[1:]
        out.append(Action(f"{what}: prefix 0x…{h & 0xFFFF:04x} ({fmt_int(tokens)} tokens)",
                          f"{fmt_ms(ms)} of prefill saved over the whole scenario ({reuses:,} re-accesses on "
                          f"{reps:,} replicas), {label}",
                          "no what-if run: predicted by the prefix ranking's cost model",
                          "Prefixes worth publishing", "prefixes", float(saved), hours))
    return out


def _capacity_action(con: duckdb.DuckDBPyConnection, scenario: str, full_tokens: int, price: Price,
                     per_day: float) -> list[Action]:
    if not has_rows(con, "capacity"):
        return []
    out = []
    for at, at2, _c_eff in rows(con, CAPACITY_ACTION_SQL, {"scenario": scenario}):
        gain = (at2 - at) * full_tokens
        if gain <= 0:
            continue
        hours = price.gpu_hours(gain)
        effect = f"{fmt_points((at2 - at) * 100)} of the full blocks' hit ratio, {fmt_int(gain)} fewer tokens"
        if hours is not None:
            effect += f", -{price.amount(gain * per_day)}/day"
        out.append(Action("Double the KV cache", effect,
                          "no what-if run: modelled by the whole scenario's miss-ratio curve (one shared LRU "
                          "of full blocks), applied to this window's full blocks",
                          "Capacity (in Top findings)", "capacity", gain, hours))
    return out


def _hygiene_action(con: duckdb.DuckDBPyConnection, scenario: str, window: Window, price: Price,
                    per_day: float) -> list[Action]:
    if not has_rows(con, "hygiene"):
        return []
    found = rows(con, HYGIENE_ACTION_SQL, window.params(scenario=scenario))
    out = []
    for n, lost in found:
        hours = price.gpu_hours(lost)
        effect = f"{fmt_int(lost)} more tokens reusable across {n:,} requests"
        if hours is not None:
            effect += f", -{price.amount(lost * per_day)}/day"
        out.append(Action("Move the dynamic part of prompts to their end", effect,
                          "no what-if run: measured by the hygiene check on the recorded prompts",
                          "Top findings", "hygiene", float(lost), hours))
    return out


def actions(con: duckdb.DuckDBPyConnection, scenario: str, what_ifs: list[str], window: Window,
            price: Price, full_tokens: int, *, limit: int = 3) -> list[Action]:
    """Up to ``limit`` actions for ``scenario`` in ``window``, the largest predicted gain first."""
    per_day = 86_400e9 / window.length_ns
    found = (_what_if_actions(con, scenario, what_ifs, window, price, per_day)
             + _prefix_action(con, scenario, price)
             + _capacity_action(con, scenario, full_tokens, price, per_day)
             + _hygiene_action(con, scenario, window, price, per_day))
    found.sort(key=lambda a: (-(a.gpu_hours if a.gpu_hours is not None else 0.0), -a.tokens, a.title))
    return found[:limit]
