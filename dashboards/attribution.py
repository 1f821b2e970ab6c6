"""Dashboards: why the hit ratio changed, window over window, attributed to causes and replicas.

Every prompt token falls in exactly one share: a hit outcome, a non-hit outcome of a full block
(per cause and replica), or the partial tail of its prompt. So ``1 - hit_ratio`` is the sum of
the non-hit shares, and the change of the hit ratio between two windows is, exactly,

    delta(hit_ratio) = - sum over (cause, replica) of delta(share) - delta(tail share)

Each term is one cause's part of the change, in points; times the current window's prompt
tokens it is the same part in tokens ("4.1 of the 6 points are evictions on replica-3", "that
is 3.0M tokens recomputed at today's volume"). Nothing is left over: a residual other than
floating-point rounding would mean the ledger does not cover every prompt token, and is shown
as such rather than hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb

from kvlens.dashboards.queries import headlines
from kvlens.dashboards.read import Window, rows
from kvlens.dashboards.report_queries import MISS_SHARES_SQL

__all__ = ["TAIL", "Attribution", "Part", "attribute", "round_to_sum"]

TAIL = "partial tail"


@dataclass(frozen=True)
class Part:
    """One cause on one replica (``replica`` None for the partial tail): its part of the change."""

    cause: str
    replica: str | None
    previous_share: float
    current_share: float
    points: float  # of the hit ratio's change: -(current_share - previous_share) * 100
    tokens: float  # the same at the current window's volume: points / 100 * current prompt tokens


@dataclass(frozen=True)
class Attribution:
    """The hit ratio in two windows and the parts of its change (largest effect first)."""

    scenario: str
    previous_ratio: float
    current_ratio: float
    current_prompt_tokens: int
    parts: tuple[Part, ...]

    @property
    def points(self) -> float:
        return (self.current_ratio - self.previous_ratio) * 100

    @property
    def tokens(self) -> float:
        return self.points / 100 * self.current_prompt_tokens

    @property
    def residual_points(self) -> float:
        """The change the parts do not explain: zero up to floating-point rounding."""
        return self.points - sum(p.points for p in self.parts)


def _shares(con: duckdb.DuckDBPyConnection, scenario: str, window: Window) -> tuple[int, float, dict] | None:
    totals = headlines(con, [scenario], window).get(scenario)
    # No tokens, or residency unknown for some (stricter than Headline.token_hit_ratio, which needs
    # only one observed token): the ledger's shares would not add up to the ratio.
    if totals is None or not totals.prompt_tokens or totals.unobserved_tokens:
        return None
    prompt = totals.prompt_tokens
    shares: dict[tuple[str, str | None], float] = {
        (cause, replica): int(tokens) / prompt
        for cause, replica, tokens in rows(con, MISS_SHARES_SQL, window.params(scenario=scenario))}
    shares[(TAIL, None)] = totals.tail_partial_tokens / prompt
    return prompt, totals.hit_tokens / prompt, shares


def attribute(con: duckdb.DuckDBPyConnection, scenario: str, window: Window) -> Attribution | None:
    """The change of ``scenario``'s token hit ratio from ``window.previous()`` to ``window``, by part.

    None when either window has no prompt tokens or holds unobserved tokens (no hit ratio).
    """
    cur = _shares(con, scenario, window)
    prev = _shares(con, scenario, window.previous())
    if cur is None or prev is None:
        return None
    prompt, ratio, now = cur
    _, before_ratio, before = prev
    parts = []
    for key in sorted(set(now) | set(before), key=lambda k: (k[0], k[1] or "")):
        a, b = before.get(key, 0.0), now.get(key, 0.0)
        points = -(b - a) * 100
        parts.append(Part(key[0], key[1], a, b, points, points / 100 * prompt))
    parts.sort(key=lambda p: (-abs(p.points), p.cause, p.replica or ""))
    return Attribution(scenario, before_ratio, ratio, prompt, tuple(parts))


def round_to_sum(values: list[float], total: float, digits: int = 1) -> list[float]:
    """Round ``values`` to ``digits`` decimals so that they add up to ``total`` rounded the same way.

    Largest remainder: each value is floored at the precision, then the units still missing go to
    the values that lost the most. Shown tables then add up exactly as printed.
    """
    scale = 10**digits
    want = round(total * scale)
    floors = [int((v * scale) // 1) for v in values]
    missing = want - sum(floors)
    order = sorted(range(len(values)), key=lambda i: -(values[i] * scale - floors[i]))
    step = 1 if missing >= 0 else -1
    if step < 0:
        order = order[::-1]
    for i in order[:abs(missing)] if order else []:
        floors[i] += step
    return [f / scale for f in floors]
