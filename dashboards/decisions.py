"""Dashboards: the first screen of the report and the overview: what happened, why, what to do, its worth.

For the production scenario (the measured one with the most prompt tokens; a what-if stands in,
named as such, when nothing was measured): its token and byte hit ratio in the window with the
change from the window before, that change attributed to causes (dashboards/attribution.py),
the recomputed tokens that were avoidable and their worth (dashboards/worth.py), and the
actions with the largest predicted gain (dashboards/actions.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb

from kvlens.dashboards.actions import Action, actions
from kvlens.dashboards.attribution import Attribution, attribute
from kvlens.dashboards.findings import CAUSES
from kvlens.dashboards.provenance import Origin
from kvlens.dashboards.queries import Headline, headlines
from kvlens.dashboards.read import Window, has_rows, rows
from kvlens.dashboards.report_queries import AVOIDABLE_SQL, PREFIX_WORTH_SQL
from kvlens.dashboards.worth import Price, price_of
from kvlens.errors import ConfigError

__all__ = ["AVOIDABLE", "Decisions", "decide", "pick_production"]

# Misses some change could have avoided: every miss but the cold ones (DESIGN.md section 1).
# Partial tails, recomputed_last blocks and unobserved blocks are not misses of a cache.
AVOIDABLE = tuple(c for c in CAUSES if c != "miss_cold")


@dataclass(frozen=True)
class Decisions:
    """Everything the first screen shows for one scenario and window."""

    scenario: str
    origin: Origin
    stand_in: str | None  # why a what-if stands in for production, when it does
    window: Window
    current: Headline
    previous: Headline | None
    attribution: Attribution | None
    avoidable: tuple[tuple[str, str, int], ...]  # (cause, replica, tokens), largest first
    prefixes: tuple[tuple[int, int, int, int], ...]  # (hash, prefix tokens, requests, avoidable tokens)
    price: Price
    actions: tuple[Action, ...]

    @property
    def avoidable_tokens(self) -> int:
        return sum(t for _, _, t in self.avoidable)

    @property
    def per_day(self) -> float:
        return 86_400e9 / self.window.length_ns

    def by_cause(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for cause, _, tokens in self.avoidable:
            out[cause] = out.get(cause, 0) + tokens
        return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))

    def by_replica(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, replica, tokens in self.avoidable:
            out[replica] = out.get(replica, 0) + tokens
        return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def pick_production(heads: dict[str, Headline], found: dict[str, Origin],
                    chosen: str | None = None) -> tuple[str, str | None] | None:
    """(scenario, why a what-if stands in or None); None when no scenario has a hit ratio."""
    if chosen is not None:
        if chosen not in heads:
            raise ConfigError(f"production scenario {chosen!r} has no requests in the window: pass one of "
                              f"{', '.join(sorted(heads)) or 'the analyzed scenarios'} to --production")
        return chosen, None
    rated = {n: h for n, h in heads.items() if h.token_hit_ratio is not None}
    measured = [n for n in rated if found[n].label == "measured"]
    if measured:
        return max(measured, key=lambda n: (rated[n].prompt_tokens, n)), None
    if not rated:
        return None
    name = min(rated, key=lambda n: (rated[n].token_hit_ratio or 0.0, n))
    return name, (f"no scenario in the window was measured: what-if {name}, the lowest hit ratio, stands in "
                  "for production (pass --production to choose)")


def decide(con: duckdb.DuckDBPyConnection, heads: dict[str, Headline], found: dict[str, Origin],
           window: Window, *, usd_per_gpu_hour: float | None = None, production: str | None = None,
           stand_in: str | None = None, prefix_limit: int = 5) -> Decisions | None:
    """The first screen for the production scenario among ``heads`` (all in ``window``).

    ``production`` names it (``stand_in`` then says why a what-if stands in, if one does); by
    default ``pick_production`` chooses.
    """
    picked = pick_production(heads, found, production)
    if picked is None:
        return None
    name, why = picked
    stand_in = stand_in if production is not None else why
    cur = heads[name]
    prev = headlines(con, [name], window.previous()).get(name)
    params = window.params(scenario=name, causes=list(AVOIDABLE))
    avoidable = tuple((c, r, int(t)) for c, r, t in rows(con, AVOIDABLE_SQL, params))
    ranked = has_rows(con, "prefix_ranking")
    prefixes = tuple((int(h), int(t), int(n or 0), int(a)) for h, t, n, a in rows(
        con, PREFIX_WORTH_SQL, {"scenario": name, "limit": prefix_limit})) if ranked else ()
    price = price_of(con, found[name].model, cur.prompt_tokens / cur.requests if cur.requests else 0,
                     usd_per_gpu_hour)
    what_ifs = [n for n in heads if n != name and found[n].label == "modelled"]
    full = cur.prompt_tokens - cur.tail_partial_tokens
    return Decisions(name, found[name], stand_in, window, cur, prev, attribute(con, name, window), avoidable,
                     prefixes, price, tuple(actions(con, name, what_ifs, window, price, full)))
