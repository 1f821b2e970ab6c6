"""Analyzers: lake relations -> Polars frames; no I/O besides the relations given.

``analyze_scenario`` runs every analysis of one scenario and yields (table, frame) pairs for
the analysis DB writer; each analysis lives in a module of its own.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import polars as pl

from kvlens.analyzers.capacity import (
    DEFAULT_TTLS_S,
    effective_capacity,
    ttl_coverage,
    ttl_coverage_out_of_core,
)
from kvlens.analyzers.costs import cost_model
from kvlens.analyzers.crossover import crossover
from kvlens.analyzers.fanout import fanout, fanout_since
from kvlens.analyzers.flows import FlowsState, flows, flows_continued, flows_out_of_core
from kvlens.analyzers.gaps import event_gaps, mark_incomplete
from kvlens.analyzers.hygiene import hygiene, hygiene_out_of_core
from kvlens.analyzers.isolation import isolation_findings, isolation_findings_out_of_core
from kvlens.analyzers.join import join_sources
from kvlens.analyzers.ledger import miss_ledger
from kvlens.analyzers.mrc import mrc, mrc_out_of_core
from kvlens.analyzers.outcomes import Ledger, Resume, block_outcomes, ledger_outcomes, rows_of
from kvlens.analyzers.partitions import Partitions
from kvlens.analyzers.provenance import scenario_provenance
from kvlens.analyzers.ranking import prefix_ranking, prefix_ranking_out_of_core
from kvlens.analyzers.reconcile import reconcile
from kvlens.analyzers.request_ledger import request_ledger
from kvlens.analyzers.reuse import ReuseState, access_stream, reuse, reuse_continued, reuse_out_of_core
from kvlens.analyzers.scans import Scans, ScanState
from kvlens.analyzers.state_blob import Pending, ready
from kvlens.analyzers.stream_summary import CurvesChain, requests_curves
from kvlens.analyzers.tails import latency_tails
from kvlens.analyzers.tiers import tier_payoff, tier_reconciliation
from kvlens.analyzers.warmup import warmup, warmup_out_of_core
from kvlens.errors import ConfigError
from kvlens.models import ModelGeometry, group_bytes_per_token

__all__ = [
    "LedgerPlan", "analyze_after_ledger", "analyze_scenario", "block_outcomes", "cost_model", "crossover",
    "effective_capacity",
    "fanout", "flows", "hygiene", "isolation_findings", "join_sources", "latency_tails", "miss_ledger", "mrc",
    "prefix_ranking", "reconcile", "request_ledger", "reuse", "tier_payoff", "tier_reconciliation",
    "ttl_coverage", "warmup",
]

log = logging.getLogger(__name__)

# SHARDS rows beside the exact curve; at 0.01 its error is stated in analyzers/mrc.py.
SHARDS_RATE = 0.01


@dataclass
class LedgerPlan:
    """How ``analyze_scenario`` computes the ledger: from ``resume`` where it can, and with a state
    saved at a checkpoint before ``horizon_ns`` (analyzers/ledger_state.py); a full replay runs in
    ``partitions`` when given; ``result`` is set once the ledger is computed."""

    horizon_ns: int | None = None
    resume: Resume | None = None
    result: Ledger | None = None
    partitions: Partitions | None = None  # replay in block-hash partitions (analyzers/partitions.py)
    # The saved states may still be being read on a worker thread (``ready`` waits for them).
    flows_resume: Pending[FlowsState] = None  # flows' state at the checkpoint ``resume`` is at
    flows_state: FlowsState | None = None  # set: flows' state at the ledger's new checkpoint
    reuse_resume: Pending[ReuseState] = None  # reuse's state, when its rows before it are kept
    reuse_state: ReuseState | None = None  # set: reuse's state at ``horizon_ns``
    reuse_since: int | None = None  # set when reuse continued: its rows from this time on are new
    # The previous analysis' windowed rows stand where the ledger continued (a copy of its DB):
    keep_windows: bool = False
    fanout_kept: bool = False  # set when they did: fanout's rows before ``fanout_since`` stand
    fanout_since: int | None = None  # the first fanout window computed again (None: none)
    reuse_refused: str | None = None  # set when reuse was given a state and could not continue
    scans_resume: Pending[ScanState] = None  # the lake aggregates' state (analyzers/scans.py)
    scans_state: ScanState | None = None  # set: their state at ``horizon_ns``
    scans_said: str | None = None  # set when given a state: whether they continued, and why not
    # Per lake table: before this time its rows are those the saved states were computed from
    # (incremental.new_rows_from), so their counts of rows before a checkpoint need no scan.
    unchanged_before: dict[str, int] = field(default_factory=dict)


def scenario_rows(con: duckdb.DuckDBPyConnection, table: str, scenario: str) -> duckdb.DuckDBPyRelation:
    """The rows of lake table ``table`` that belong to ``scenario``: the one scope every analysis reads."""
    return con.table(table).filter(duckdb.ColumnExpression("scenario") == duckdb.ConstantExpression(scenario))


def scenario_row(con: duckdb.DuckDBPyConnection, scenario: str, model: ModelGeometry, *,
                 requests: duckdb.DuckDBPyRelation, counted: int, needed_blocks: int,
                 model_source: str) -> pl.DataFrame:
    """``scenario``'s row of table ``scenarios``: its model and where it came from, its counts
    (``counted`` requests in its request ledger, ``needed_blocks`` outcome rows) and where its
    figures come from (analyzers/provenance.py, from ``requests``)."""
    origin = scenario_provenance(requests=requests, simulations=scenario_rows(con, "simulations", scenario))
    return pl.DataFrame({
        "scenario": [scenario], "model": [model.name], "kv_bytes_per_token": [model.kv_bytes_per_token()],
        "requests": [counted], "needed_blocks": [needed_blocks],
        "analyzed_ns": [time.time_ns()], "model_source": [model_source], "provenance": [origin.provenance],
        "sources": [origin.sources], "ttft_label": [origin.ttft_label], "assumptions": [origin.assumptions]},
        schema_overrides={"ttft_label": pl.String, "assumptions": pl.String})


# The request ledger's columns the analyses after the ledger read (latency tails, reconciliation).
_PER_REQUEST = ("scenario", "replica", "arrival_ns", "prompt_tokens", "hit_tokens", "recomputed_last_tokens",
                "miss_tokens", "cached_tokens", "dominant_miss", "ttft_ms", "queue_ms")


def analyze_after_ledger(con: duckdb.DuckDBPyConnection, scenario: str, model: ModelGeometry, *,
                         work: Path, partitions: int, metrics_from: str | None = None,
                         cache_tokens: int | None = None, skipped: list[str] | None = None
                         ) -> Iterator[tuple[str, pl.DataFrame]]:
    """The analyses after the ledger, out of core (``kvlens analyze --out-of-core``, issue 17): as
    ``analyze_scenario`` computes them, from the scenario's ``block_outcomes`` and
    ``request_ledger`` rows already in the analysis DB on ``con`` rather than from frames.

    Each reads the outcomes through DuckDB, which groups them spilling past its memory limit, and
    gets back only its small aggregates; the request ledger is read as the few columns the latency
    tails and the reconciliation need (about 80 bytes per request: memory O(requests), not
    O(block accesses)). The rows are those ``analyze_scenario`` writes (tests/test_ooc_analyses.py).
    ``metrics_from``: the scenario holding the engines' scraped metrics, as for ``analyze_scenario``.
    The analyses that cut the rows into partitions of their own (the prefix ranking: ranges of
    requests, then partitions of prefix tips; hygiene: requests, content hashes, run keys; warmup
    and isolation, the outcomes and keys they cannot group in DuckDB alone; flows, the events, hits
    and transfers by block hash) spill to a directory of their own in ``work`` (removed when the
    next one starts), and start from ``partitions``, the ledger's count of block-hash partitions.
    The reuse distances and their curves read the `requests` stream once, in
    time order in chunks, on one LRU stack (analyzers/reuse.py ``reuse_out_of_core``): O(distinct
    blocks) in memory; ``reuse``'s rows, one per re-access, are written in pieces. A stream whose
    full blocks have several sizes is not read out of core: then ``reuse``, ``mrc``,
    ``ttl_coverage`` and ``capacity`` are not written, with a warning, and why goes to ``skipped``.
    ``cache_tokens``: the ``capacity`` row, as for ``analyze_scenario``.
    """

    def spill(name: str) -> Path:
        where = work / name
        shutil.rmtree(work, ignore_errors=True)  # the previous analysis' files: read, and no longer needed
        where.mkdir(parents=True)
        return where

    per_token = model.kv_bytes_per_token()
    requests = scenario_rows(con, "requests", scenario)
    blocks = scenario_rows(con, "request_blocks", scenario)
    events = scenario_rows(con, "kv_events", scenario)
    samples = scenario_rows(con, "metric_samples", scenario)
    outcomes = scenario_rows(con, "block_outcomes", scenario)
    scans = Scans({"kv_events": (events, "ts_ns"), "request_blocks": (blocks, "arrival_ns")}, None, None)
    yield "isolation_findings", isolation_findings_out_of_core(
        con, scenario, work=spill("isolation_findings"), partitions=partitions, bytes_per_token=per_token)
    yield "warmup", warmup_out_of_core(con, scenario, work=spill("warmup"), partitions=partitions)
    yield "tier_payoff", tier_payoff(block_outcomes=outcomes, kv_events=events, scenario=scenario,
                                     bytes_per_token=per_token,
                                     group_bytes_per_token=group_bytes_per_token(model), scans=scans)
    yield "flows", flows_out_of_core(con, scenario, work=spill("flows"), partitions=partitions,
                                     bytes_per_token=per_token)
    yield "fanout", fanout(block_outcomes=outcomes)
    per_request = scenario_rows(con, "request_ledger", scenario).select(*_PER_REQUEST).pl()
    yield "latency_tails", latency_tails(request_ledger=per_request)
    metrics = scenario_rows(con, "metric_samples", metrics_from) if metrics_from else samples
    ((scraped,),) = metrics.aggregate("count(*)").fetchall()
    if scraped:
        yield "reconciliation", reconcile(metric_samples=metrics, request_ledger=per_request,
                                          scenario=scenario)
    del per_request  # (before the reuse distances, the largest step)
    costs = cost_model(probe_runs=con.table("probe_runs"), model=model)
    chain = CurvesChain(rate=SHARDS_RATE, ttls_s=DEFAULT_TTLS_S)
    try:
        pieces = reuse_out_of_core(con, scenario, work=spill("reuse"), partitions=partitions,
                                   bytes_per_token=per_token, on_chunk=chain.add)
    except ConfigError as e:
        log.warning("%s: reuse, mrc, ttl_coverage and capacity are not written", e)
        if skipped is not None:
            skipped.append(f"reuse, mrc, ttl_coverage and capacity not written: {e}")
    else:
        for piece in pieces:
            yield "reuse", piece
        curve = mrc_out_of_core(con, scenario, work=work, partitions=partitions, bytes_per_token=per_token,
                                sample_rate=SHARDS_RATE, chain=chain)
        yield "mrc", curve
        yield "ttl_coverage", ttl_coverage_out_of_core(con, scenario, work=work, partitions=partitions,
                                                       bytes_per_token=per_token, chain=chain)
        if cache_tokens is not None:
            ((block,),) = blocks.aggregate("max(block_size_tokens)").fetchall()
            yield "capacity", effective_capacity(
                mrc=curve, physical_bytes=cache_tokens * per_token, bytes_per_token=per_token,
                scenario=scenario, metric_samples=samples, block_size_tokens=int(block or 16))
    del chain
    yield "hygiene", hygiene_out_of_core(con, scenario, work=spill("hygiene"), partitions=partitions,
                                         bytes_per_token=per_token)
    yield "crossover", crossover(costs=costs, scenario=scenario)
    yield "prefix_ranking", prefix_ranking_out_of_core(con, scenario, work=spill("prefix_ranking"),
                                                       partitions=partitions, costs=costs)
    yield "tier_reconciliation", tier_reconciliation(
        block_outcomes=outcomes, requests=requests, metric_samples=metrics, scenario=scenario)


def analyze_scenario(con: duckdb.DuckDBPyConnection, scenario: str, model: ModelGeometry,
                     *, cache_tokens: int | None = None, join: Sequence[str] = (),
                     metrics_from: str | None = None, model_source: str = "given",
                     ledger: LedgerPlan | None = None) -> Iterator[tuple[str, pl.DataFrame]]:
    """Every analysis of ``scenario`` over the lake views on ``con``, as (table, frame) pairs.

    The lake relations are scoped to ``scenario`` here, once; the analyses read only what they are
    given. ``cache_tokens``: the KV cache the scenario's requests are served from, in tokens (all
    replicas together); with it, the ``capacity`` row places C_eff on the curve. ``join``:
    scenarios whose requests fill this one's missing columns by request id (span timings,
    reported cached tokens); the ledger then reads the joined requests. ``metrics_from``: the
    scenario holding the engines' scraped metrics (default: this one); when it has samples,
    ``reconciliation`` sets the engines' own hit counters beside the ledger. ``model_source``:
    where ``model`` came from, recorded in ``scenarios`` (``given``, ``requests`` or ``default``:
    assumed because nothing named one), so every byte figure can say what it assumed. ``ledger``:
    continue the ledger from a saved state, and save one (``kvlens analyze``'s incremental runs).
    """
    per_token = model.kv_bytes_per_token()
    group_rates = group_bytes_per_token(model)
    requests = scenario_rows(con, "requests", scenario)
    blocks = scenario_rows(con, "request_blocks", scenario)
    events = scenario_rows(con, "kv_events", scenario)
    transfers = scenario_rows(con, "transfers", scenario)
    samples = scenario_rows(con, "metric_samples", scenario)
    if join:
        joined, report = join_sources(requests=con.table("requests"), scenario=scenario, sources=join)
        yield "request_sources", report
        requests = con.from_arrow(joined.to_arrow())  # a relation on con, under no catalog name
    plan = ledger if ledger is not None else LedgerPlan()
    plan.result = ledger_outcomes(
        requests=requests, request_blocks=blocks, kv_events=events, transfers=transfers, scenario=scenario,
        bytes_per_token=per_token, group_bytes_per_token=group_rates, horizon_ns=plan.horizon_ns,
        resume=plan.resume, partitions=plan.partitions)
    outcomes = plan.result.frame
    gaps, clears = event_gaps(metric_samples=samples, kv_events=events)
    result, settled, summed = plan.result, None, outcomes
    if result.appended is not None and result.replaced is not None and plan.resume is not None \
            and plan.resume.requests is not None:
        # the requests the continued ledger did not replay keep their previous sums
        settled = rows_of(plan.resume.requests, result.replaced)
        summed = result.appended
    per_request = mark_incomplete(request_ledger(block_outcomes=summed, requests=requests, settled=settled),
                                  gaps, clears)
    yield "scenarios", scenario_row(con, scenario, model, requests=requests, counted=per_request.height,
                                    needed_blocks=outcomes.height, model_source=model_source)
    yield "block_outcomes", outcomes
    yield "request_ledger", per_request
    # The analyses that save a state come first, each state packed on the state worker
    # (analyzers/incremental.py) while the analyses after it run rather than while the DB waits for
    # it: the lake aggregates' users, flows, reuse; then the analyses that only read.
    scans = Scans({"kv_events": (events, "ts_ns"), "request_blocks": (blocks, "arrival_ns")},
                  scans_resume := ready(plan.scans_resume), plan.horizon_ns,
                  unchanged_before=plan.unchanged_before)
    yield "isolation_findings", isolation_findings(
        requests=requests, request_blocks=blocks, kv_events=events, block_outcomes=outcomes,
        scenario=scenario, bytes_per_token=per_token, scans=scans)
    yield "warmup", warmup(request_ledger=per_request, block_outcomes=outcomes, kv_events=events,
                           scenario=scenario, scans=scans)
    yield "tier_payoff", tier_payoff(block_outcomes=outcomes, kv_events=events, scenario=scenario,
                                     bytes_per_token=per_token, group_bytes_per_token=group_rates,
                                     scans=scans)
    plan.scans_state = scans.state()
    if scans_resume is not None:
        plan.scans_said = (f"lake aggregates continued from {scans_resume.checkpoint_ns} ns"
                           if scans.resume is not None
                           else f"lake aggregates computed in full: {scans.refused}")
    flows_resume = ready(plan.flows_resume)
    continued = (flows_resume if result.appended is not None and plan.resume is not None
                 and flows_resume is not None
                 and flows_resume.checkpoint_ns == plan.resume.checkpoint_ns else None)
    byte_flows, plan.flows_state = flows_continued(
        block_outcomes=outcomes, request_ledger=per_request, kv_events=events, transfers=transfers,
        scenario=scenario, bytes_per_token=per_token, resume=continued,
        checkpoint_ns=result.state.checkpoint_ns if result.state is not None else None, requests=requests,
        events_unchanged_before=plan.unchanged_before.get("kv_events"),
        loads_from=result.loads_from if continued is not None else None)
    yield "flows", byte_flows
    reuse_resume = ready(plan.reuse_resume)
    # The `requests` stream from the state's stack on, where it kept one (its accesses of one size);
    # the partitioned curve reads the whole stream.
    stream = access_stream(blocks, scenario, per_token, requests,
                           prior=reuse_resume if plan.partitions is None else None,
                           unchanged_before=plan.unchanged_before.get("request_blocks"))
    reused = reuse_continued(kv_events=events, bytes_per_token=per_token, scenario=scenario, stream=stream,
                             resume=reuse_resume, checkpoint_ns=plan.horizon_ns,
                             events_unchanged_before=plan.unchanged_before.get("kv_events"),
                             earlier=scenario_rows(con, "reuse", scenario),
                             whole=lambda: access_stream(blocks, scenario, per_token, requests))
    stream = reused.stream or stream
    curves = requests_curves(stream, rate=SHARDS_RATE, ttls_s=DEFAULT_TTLS_S, cut_ns=plan.horizon_ns)
    plan.reuse_state = (reused.state.with_requests(curves.stack if curves else None,
                                                   curves.summary if curves else None)
                        if reused.state is not None else None)
    plan.reuse_since, plan.reuse_refused = reused.since, reused.refused
    yield "reuse", reused.frame
    curve = mrc(request_blocks=blocks, bytes_per_token=per_token, scenario=scenario,
                sample_rate=SHARDS_RATE, stream=stream, partitions=plan.partitions, curves=curves)
    yield "mrc", curve
    yield "ttl_coverage", ttl_coverage(request_blocks=blocks, bytes_per_token=per_token, scenario=scenario,
                                       stream=stream, curves=curves)
    if cache_tokens is not None:
        ((block,),) = blocks.aggregate("max(block_size_tokens)").fetchall()
        yield "capacity", effective_capacity(
            mrc=curve, physical_bytes=cache_tokens * per_token, bytes_per_token=per_token, scenario=scenario,
            metric_samples=samples, block_size_tokens=int(block or 16))
    yield "miss_ledger", miss_ledger(block_outcomes=outcomes, incomplete=per_request)
    yield "hygiene", hygiene(request_blocks=blocks, scenario=scenario, bytes_per_token=per_token)
    plan.fanout_kept = plan.keep_windows and result.appended is not None
    if plan.fanout_kept and result.appended is not None:
        plan.fanout_since = since = fanout_since(result.appended)
        yield "fanout", fanout(block_outcomes=outcomes.clear() if since is None
                               else outcomes.filter(pl.col("arrival_ns") >= since))
    else:
        yield "fanout", fanout(block_outcomes=outcomes)
    yield "latency_tails", latency_tails(request_ledger=per_request)
    costs = cost_model(probe_runs=con.table("probe_runs"), model=model)
    yield "crossover", crossover(costs=costs, scenario=scenario)
    yield "prefix_ranking", prefix_ranking(block_outcomes=outcomes, costs=costs, scenario=scenario)
    metrics = scenario_rows(con, "metric_samples", metrics_from) if metrics_from else samples
    ((scraped,),) = metrics.aggregate("count(*)").fetchall()
    if scraped:
        yield "reconciliation", reconcile(metric_samples=metrics, request_ledger=per_request,
                                          scenario=scenario)
    yield "tier_reconciliation", tier_reconciliation(
        block_outcomes=outcomes, requests=requests, metric_samples=metrics, scenario=scenario)
