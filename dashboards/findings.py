"""Dashboards: the report's top findings, as sentences computed from the analysis DB.

Each finder reads one analysis (the ledger, the what-if scenarios beside it, capacity, latency
tails, prefix ranking, hygiene, isolation, flows, warm-up) and says nothing when its table is
absent or empty: a finding is never made up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import duckdb

from kvlens.dashboards.formatting import fmt_bytes, fmt_ms, fmt_pct
from kvlens.dashboards.provenance import Origin, origins, tagged
from kvlens.dashboards.queries import headlines
from kvlens.dashboards.read import Window, has_rows, rows
from kvlens.dashboards.report_queries import (
    CAPACITY_FINDING_SQL,
    COLD_SHARE_SQL,
    CROSSOVER_FINDING_SQL,
    FANOUT_FINDING_SQL,
    HYGIENE_FINDING_SQL,
    ISOLATION_FINDING_SQL,
    NEVER_READ_SQL,
    SLOWEST_CLASS_SQL,
    SLOWEST_WARMUP_SQL,
    TOP_PREFIX_SQL,
    UNOBSERVED_SQL,
    WHAT_IF_SERVED_SQL,
    WORST_REPLICA_SQL,
)

__all__ = ["CAUSES", "findings", "fmt_bytes", "fmt_ms", "fmt_pct", "ranked_findings"]

# Why a block missed, in words (DESIGN.md section 1).
CAUSES = {
    "miss_routing": "the block lived on another replica",
    "miss_evicted": "the block had been evicted",
    "miss_cold": "the block had never been computed before",
    "miss_incompatible": "the block was cached under another cache key",
    "miss_load_failed": "loading the block failed",
    "miss_after_gap": "KV events were lost around it (a sequence gap)",
    "miss_group": "another KV cache group (a sliding window) cut the hit short before it",
}
_ACTIONABLE = tuple(c for c in CAUSES if c != "miss_cold")

Context = dict[str, Any]
# A sentence, or a sentence with the recomputed tokens it concerns (what ranks it).
Found = str | tuple[str, int]


def _ledger_findings(con: duckdb.DuckDBPyConnection, p: Context) -> list[Found]:
    out: list[Found] = []
    for scenario, outcome, fleet_share, replica, replica_share, tokens in rows(con, WORST_REPLICA_SQL, p):
        text = (f"In {_who(scenario, p)}, {fmt_pct(fleet_share)} of prompt tokens missed because "
                f"{CAUSES[outcome]} ({outcome}); the worst replica is {replica}, where it cost "
                f"{fmt_pct(replica_share)} of its prompt tokens.")
        served = [(s, (hit or 0) / total) for s, total, hit in rows(
            con, WHAT_IF_SERVED_SQL, {**p, "scenario": scenario, "replica": replica, "outcome": outcome})
            if total]
        if served:
            text += " Of those tokens, " + ", ".join(
                f"{_who(s, p)} served {fmt_pct(r)}" for s, r in served
            ) + " (the same requests replayed there)."
        out.append((text, int(tokens)))
    return out


def _compare_findings(con: duckdb.DuckDBPyConnection, p: Context) -> list[str]:
    """The scenarios with the highest and the lowest token hit ratio (``Headline``'s, the one the
    headline shows); a scenario none of whose replicas published KV events has none."""
    totals = headlines(con, p["names"], Window(p["start_ns"], p["end_ns"]))
    ranked = sorted(((s, h.token_hit_ratio) for s, h in totals.items() if h.token_hit_ratio is not None),
                    key=lambda sr: (-sr[1], sr[0]))
    if len(ranked) < 2:
        return []
    (best, hi), (worst, lo) = ranked[0], ranked[-1]
    return [f"{best} has the highest token hit ratio ({_labelled(fmt_pct(hi), best, p)}), "
            f"{(hi - lo) * 100:.1f} points above {worst} ({_labelled(fmt_pct(lo), worst, p)})."]


def _cold_findings(con: duckdb.DuckDBPyConnection, p: Context) -> list[str]:
    shares = [(s, r) for s, r in rows(con, COLD_SHARE_SQL, p) if r]
    if not shares:
        return []
    if len(shares) > 1 and max(r for _, r in shares) - min(r for _, r in shares) < 0.0005:
        where = "every scenario"
    else:
        return [f"In {_who(s, p)}, {fmt_pct(r)} of prompt tokens were needed for the first time (miss_cold): "
                "no cache could have served them." for s, r in shares]
    label = _all_label([s for s, _ in shares], p)
    return [f"In {where}{label}, {fmt_pct(shares[0][1])} of prompt tokens were needed for the first time "
            "(miss_cold): no cache could have served them."]


def _unobserved_findings(con: duckdb.DuckDBPyConnection, p: Context) -> list[str]:
    return [f"In {s}, {fmt_pct(share)} of prompt tokens (their full blocks) ran on replicas that "
            "published no KV events (unobserved): whether they were cached is unknown, so they are counted "
            f"neither as hits nor as misses. An unbounded cache could have served {fmt_pct(reusable)} of "
            "those requests' prompt tokens (modelled: every full block an earlier request needed, no "
            "capacity limit)."
            for s, share, reusable in rows(con, UNOBSERVED_SQL, p)]


def _cache_words(c_eff: int, subtracted: int, active_source: str | None) -> str:
    """C_eff named for what it is: with nothing subtracted it is just the configured cache."""
    if not subtracted:
        return (f"the configured cache of {fmt_bytes(c_eff)} (kvlens analyze --cache-tokens; nothing "
                "measured to subtract, so C_eff = C_physical)")
    source = {"kv_cache_usage_perc": "decode measured from kv_cache_usage_perc",
              "running_requests": "decode estimated from running requests"}.get(str(active_source), "")
    return (f"the effective cache of {fmt_bytes(c_eff)} ({fmt_bytes(subtracted)} subtracted"
            f"{': ' + source if source else ''})")


def _capacity_findings(con: duckdb.DuckDBPyConnection, p: Context) -> list[str]:
    out = []
    for names, c_eff, at, at2, subtracted, active_source, full_share in rows(con, CAPACITY_FINDING_SQL, p):
        who = "every scenario" if len(names) == len(p["names"]) > 1 else ", ".join(names)
        share = f" ({fmt_pct(at * full_share)} of prompt bytes)" if full_share is not None else ""
        out.append(f"Capacity ({who}, whole scenario): {_cache_words(c_eff, subtracted, active_source)}, "
                   f"modelled as one shared LRU of full blocks, would serve {fmt_pct(at)} of the full "
                   f"blocks' bytes{share}; doubling it would serve {fmt_pct(at2)} "
                   f"({(at2 - at) * 100:+.1f} points, modelled){_bytes_note(names, p)}.")
    return out


def _latency_findings(con: duckdb.DuckDBPyConnection, p: Context) -> list[str]:
    out = []
    for scenario, cls, n, p50, p99, ratio in rows(con, SLOWEST_CLASS_SQL, p):
        o = _origin(scenario, p)
        flag = " (a tail ratio above 5)" if ratio is not None and ratio > 5 else ""
        ratio_text = f", {ratio:.1f}x their P50 of {o.ttft(fmt_ms(p50))}{flag}" if ratio is not None else ""
        out.append(f"In {_who(scenario, p)}, the slowest prefix class is {cls} ({n:,} requests, whole "
                   f"scenario): TTFT P99 {o.ttft(fmt_ms(p99))}{ratio_text}.")
    return out


def _labels(recompute: str | None, load: str | None) -> str:
    said = [f"{w} {label}" for w, label in (("recompute", recompute), ("load", load)) if label]
    return f" ({', '.join(said)})" if said else ""


def _prefix_findings(con: duckdb.DuckDBPyConnection, p: Context) -> list[Found]:
    return [(f"In {_who(s, p)}, the prefix worth most is {h:016x} ({tok:,} tokens, {reuses:,} re-accesses on "
            f"{reps:,} replicas): {rec}, an expected {(ms or 0) / 1e3:,.1f} s of prefill saved"
            f"{_labels(rl, ll)}; {str(reason).rstrip('.')}.", int(avoidable))
            for s, h, tok, reuses, reps, ms, rec, reason, rl, ll, avoidable in rows(con, TOP_PREFIX_SQL, p)]


def _hygiene_findings(con: duckdb.DuckDBPyConnection, p: Context) -> list[Found]:
    return [(f"In {_who(s, p)}, {n:,} requests split their prefix chain early: moving the dynamic part to "
            f"the end would make {tok or 0:,} more tokens ({fmt_bytes(b)}{_bytes_note([s], p)}) reusable.",
             int(tok or 0)) for s, n, tok, b in rows(con, HYGIENE_FINDING_SQL, p)]


def _isolation_findings(con: duckdb.DuckDBPyConnection, p: Context) -> list[str]:
    return [f"In {_who(s, p)}, {n:,} {finding} finding(s){f' (severity {sev})' if sev else ''} over "
            f"{blocks or 0:,} blocks, e.g. {detail}" + ("" if str(detail).endswith(".") else ".")
            for s, finding, sev, n, blocks, detail in rows(con, ISOLATION_FINDING_SQL, p)]


def _flow_findings(con: duckdb.DuckDBPyConnection, p: Context) -> list[str]:
    return [f"In {_who(s, p)}, {fmt_bytes(never)} of the {fmt_bytes(written)} written to the {tier} tier "
            f"were removed without ever being read ({fmt_pct(never / written if written else None)})"
            f"{_bytes_note([s], p)}."
            for s, tier, written, never in rows(con, NEVER_READ_SQL, p)]


def _warmup_findings(con: duckdb.DuckDBPyConnection, p: Context) -> list[Found]:
    out: list[Found] = []
    for s, r, ns, b, saved in rows(con, SLOWEST_WARMUP_SQL, p):
        text = (f"In {_who(s, p)}, {r} took the longest to warm up: {ns / 60e9:.1f} min to the fleet's "
                f"steady hit ratio; pre-warming its hot prefixes would move "
                f"{fmt_bytes(b)}{_bytes_note([s], p)}")
        out.append((text + (f" and save {saved:,} recomputed tokens." if saved else "."), int(saved or 0)))
    return out


def _crossover_findings(con: duckdb.DuckDBPyConnection, p: Context) -> list[str]:
    by_device: dict[tuple[str, str], list[str]] = {}
    labels: dict[tuple[str, str], set[str]] = {}
    found = rows(con, CROSSOVER_FINDING_SQL, p)
    for device, model, path, from_tokens, longest, load_label, rec_label in found:
        said = (f"never over {path} (up to {longest:,} tokens)" if from_tokens is None
                else f"from {from_tokens:,} tokens over {path}")
        by_device.setdefault((device, model), []).append(said)
        labels.setdefault((device, model), set()).update(
            f"{w} {x}" for w, lab in (("load", load_label), ("recompute", rec_label)) for x in lab.split("/"))
    return [f"On {device} ({model}), loading a prefix beats recomputing it {', '.join(said)} "
            f"({', '.join(sorted(labels[(device, model)]))})."
            for (device, model), said in by_device.items()]


def _fanout_findings(con: duckdb.DuckDBPyConnection, p: Context) -> list[str]:
    return [f"In {_who(s, p)}, {shared:,} of {needed:,} distinct blocks needed per window "
            f"({fmt_pct(shared / needed if needed else None)}) were needed by two replicas or more "
            f"(up to {most:,}): {fmt_bytes(dup)} of KV held or computed more than once{_bytes_note([s], p)}."
            for s, needed, shared, most, dup in rows(con, FANOUT_FINDING_SQL, p)]


def _origin(scenario: str, p: Context) -> Origin:
    found: dict[str, Origin] = p["origins"]
    return found.get(scenario, Origin(scenario))


def _who(scenario: str, p: Context) -> str:
    """The scenario with its figures' label: ``rr8 (modelled)``."""
    return tagged(scenario, p["origins"])


def _labelled(text: str, scenario: str, p: Context) -> str:
    label = _origin(scenario, p).label
    return f"{text}, {label}" if label else text


def _all_label(names: list[str], p: Context) -> str:
    labels = {_origin(n, p).label for n in names}
    return f" ({labels.pop()})" if len(labels) == 1 and None not in labels else ""


def _bytes_note(names: list[str], p: Context) -> str:
    """Beside a byte figure resting on the default geometry: say that it was assumed."""
    assumed = sorted({str(_origin(n, p).model) for n in names if _origin(n, p).assumed_bytes})
    return f"; bytes assume {', '.join(assumed)}'s KV geometry: no model was given" if assumed else ""


# (table whose rows the finder needs, finder), in the order the report lists them.
FINDERS: tuple[tuple[str, Callable[[duckdb.DuckDBPyConnection, Context], Sequence[Found]]], ...] = (
    ("block_outcomes", _ledger_findings),
    ("request_ledger", _compare_findings),
    ("block_outcomes", _cold_findings),
    ("request_ledger", _unobserved_findings),
    ("latency_tails", _latency_findings),
    ("prefix_ranking", _prefix_findings),
    ("flows", _flow_findings),
    ("fanout", _fanout_findings),
    ("hygiene", _hygiene_findings),
    ("isolation_findings", _isolation_findings),
    ("warmup", _warmup_findings),
    ("crossover", _crossover_findings),
    ("capacity", _capacity_findings),
)


def ranked_findings(con: duckdb.DuckDBPyConnection, names: list[str],
                    window: Window) -> list[tuple[str, int | None]]:
    """(sentence, recomputed tokens it concerns or None), most tokens first; None after, in FINDERS order.

    The tokens are what a finding is worth: each priced alike by the cost model (dashboards/worth.py).
    """
    p: Context = window.params(names=names, actionable=list(_ACTIONABLE), origins=origins(con, names))
    out: list[tuple[str, int | None]] = []
    for table, finder in FINDERS:
        if has_rows(con, table):
            out += [(f, None) if isinstance(f, str) else f for f in finder(con, p)]
    order = sorted(range(len(out)), key=lambda i: (out[i][1] is None, -(out[i][1] or 0), i))
    return [out[i] for i in order]


def findings(con: duckdb.DuckDBPyConnection, names: list[str], window: Window) -> list[str]:
    """The findings for the window's requests, one sentence (or two) each, ranked by worth."""
    return [text for text, _ in ranked_findings(con, names, window)]
