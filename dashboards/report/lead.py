"""Dashboards: the report's decision-first part: the first screen, why it changed, what misses are worth.

Turns dashboards/decisions.py's ``Decisions`` into the report's lead (headline, change, avoidable
worth, three actions, all above the first chart) and two sections: the day-over-day attribution
table (its rows add up to the change as printed) and the worth tables per cause, replica and prefix.
"""

from __future__ import annotations

from kvlens.dashboards.attribution import TAIL, Attribution, Part, round_to_sum
from kvlens.dashboards.decisions import Decisions
from kvlens.dashboards.findings import CAUSES
from kvlens.dashboards.formatting import fmt_gpu_hours, fmt_int, fmt_pct, fmt_points, fmt_usd
from kvlens.dashboards.report.render import Lead, Section, Table

__all__ = ["ATTRIBUTION_ROWS", "attribution_section", "change_sentence", "lead", "worth_section"]

ATTRIBUTION_ROWS = 10  # parts listed by name; the rest are summed into one row


def change_sentence(d: Decisions) -> str:
    """The change from the window before and its three largest causes, in one sentence."""
    if d.previous is None or d.previous.token_hit_ratio is None or d.current.token_hit_ratio is None:
        return "Change: nothing to compare (no requests with a hit ratio in the window before)."
    a = d.attribution
    byte = ""
    if d.previous.byte_hit_ratio is not None and d.current.byte_hit_ratio is not None:
        byte = f", byte hit ratio {fmt_points((d.current.byte_hit_ratio - d.previous.byte_hit_ratio) * 100)}"
    said = (f"Change from the window before: token hit ratio {fmt_pct(d.previous.token_hit_ratio)} to "
            f"{fmt_pct(d.current.token_hit_ratio)}, "
            f"{fmt_points((d.current.token_hit_ratio - d.previous.token_hit_ratio) * 100)}{byte}")
    if a is None:
        return said + "."
    by_cause: dict[str, list[Part]] = {}
    for p in a.parts:
        by_cause.setdefault(p.cause, []).append(p)
    causes = sorted(by_cause.items(), key=lambda kv: (-abs(sum(p.points for p in kv[1])), kv[0]))
    top = causes[:3]
    values = [sum(p.points for p in parts) for _, parts in top]
    shown = round_to_sum([*values, a.points - sum(values)], a.points)
    said_parts = []
    for v, (cause, parts) in zip(shown, top, strict=False):
        words = "partial tails" if cause == TAIL else f"{'fewer' if v > 0 else 'more'} {cause}"
        worst = max(parts, key=lambda p: (p.points if v > 0 else -p.points))
        where = f" (most on {worst.replica}: {worst.points:+.1f})" if worst.replica and len(parts) > 1 else (
            f" on {worst.replica}" if worst.replica else "")
        said_parts.append(f"{v:+.1f} from {words}{where}")
    if len(causes) > 3:
        said_parts.append(f"{shown[-1]:+.1f} from the rest")
    return f"{said}; of those points {', '.join(said_parts)} (see Why it changed)."


def lead(d: Decisions) -> Lead:
    """The first screen: headline, change, avoidable worth, the actions."""
    label = d.origin.label or "not recorded"
    who = f"{d.scenario} ({label}, a what-if standing in for production)" if d.stand_in else (
        f"{d.scenario} ({label})")
    headline = (f"{who}: token hit ratio {fmt_pct(d.current.token_hit_ratio)}, byte hit ratio "
                f"{fmt_pct(d.current.byte_hit_ratio)}, over {fmt_int(d.current.requests)} requests and "
                f"{fmt_int(d.current.prompt_tokens)} prompt tokens.")
    tokens = d.avoidable_tokens
    share = tokens / d.current.prompt_tokens if d.current.prompt_tokens else None
    avoidable = (f"Avoidable: {fmt_int(tokens)} recomputed tokens ({fmt_pct(share)} of prompt tokens, every "
                 f"miss but miss_cold), worth {d.price.words(tokens, per_day=d.per_day)}.")
    acts = tuple((a.title, a.effect, a.basis + f"; evidence: {a.evidence}") for a in d.actions)
    title = "What happened, and what to do first"
    if len(acts) < 3:
        title += f" (only {len(acts)} action{'s' if len(acts) != 1 else ''} with a gain found)"
    note = " ".join(x for x in (d.stand_in and d.stand_in[0].upper() + d.stand_in[1:] + ".",
                                f"Price: {d.price.assumptions}.") if x)
    return Lead(title, (("headline", headline), ("change", change_sentence(d)), ("avoidable", avoidable)),
                acts, note)


def attribution_section(a: Attribution | None) -> Section | None:
    """The attribution table; its points and tokens columns add up, as printed, to the change."""
    if a is None:
        return None
    top = list(a.parts[:ATTRIBUTION_ROWS])
    rest = list(a.parts[ATTRIBUTION_ROWS:])
    points = [p.points for p in top] + ([sum(p.points for p in rest)] if rest else [])
    shown = round_to_sum(points, a.points)
    tokens = round_to_sum([v / 100 * a.current_prompt_tokens for v in points], a.tokens, digits=0)
    body = [(p.cause if p.cause == TAIL else f"{p.cause} ({CAUSES.get(p.cause, p.cause)})"
             if p.cause in CAUSES else p.cause, p.replica or "", fmt_pct(p.previous_share),
             fmt_pct(p.current_share), f"{v:+.1f}", f"{t:+,.0f}")
            for p, v, t in zip(top, shown, tokens, strict=False)]
    if rest:
        body.append((f"{len(rest)} other parts", "", "", "", f"{shown[-1]:+.1f}", f"{tokens[-1]:+,.0f}"))
    body.append(("total: every non-hit share (1 - hit ratio)", "", fmt_pct(1 - a.previous_ratio),
                 fmt_pct(1 - a.current_ratio), f"{round(a.points, 1):+.1f}", f"{round(a.tokens):+,.0f}"))
    return Section("Why it changed", paragraphs=[
        f"{a.scenario}: every prompt token is a hit, a miss of one cause on one replica, or a partial tail, "
        "so "
        "the hit ratio's change is exactly the sum of the non-hit shares' changes (a share that fell raised "
        "the hit ratio). Points are of the token hit ratio; tokens are those points at this window's "
        f"{fmt_int(a.current_prompt_tokens)} prompt tokens. Rounded so that the rows add up as printed."],
        tables=[Table(("cause", "replica", "share before", "share now", "points", "tokens"), tuple(body))])


def worth_section(d: Decisions) -> Section:
    """What the avoidable recomputed tokens are worth, per cause, per replica and per prefix."""
    p = d.price

    def cells(tokens: float) -> tuple[str, str, str]:
        hours, usd = p.gpu_hours(tokens), p.usd(tokens)
        money = (fmt_usd(usd) if usd is not None else "n/a (pass --gpu-hour-price)" if hours is not None
                 else "n/a")
        return fmt_int(tokens), fmt_gpu_hours(hours), money

    head = ("tokens", f"GPU-hours ({p.label or 'n/a'})", "USD")
    causes = tuple((c, *cells(t)) for c, t in d.by_cause().items())
    replicas = tuple((r, *cells(t)) for r, t in d.by_replica().items())
    tables = [Table(("cause", *head), causes), Table(("replica", *head), replicas)]
    said = [f"The window's avoidable recomputed tokens in {d.scenario}, priced at the cost model's per-token "
            f"price: {p.assumptions}."]
    if d.prefixes:
        tables.append(Table(("prefix (whole scenario)", "prefix tokens", "requests", *head), tuple(
            (f"{h:016x}", fmt_int(t), fmt_int(n), *cells(a)) for h, t, n, a in d.prefixes)))
        said.append("Per prefix: the miss_routing and miss_evicted tokens of its segment over the whole "
                    "scenario (the prefix ranking's), priced the same way.")
    return Section("What the avoidable misses are worth", paragraphs=said, tables=tables)
