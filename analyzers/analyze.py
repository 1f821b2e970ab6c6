"""analyzers' front door for ``kvlens analyze``: a lake -> the analysis DB, models resolved here.

Incremental by default: a scenario whose inputs are unchanged since the previous analysis DB is
carried over from it, anything else is analyzed from the lake (analyzers/incremental.py says
what counts as new data and when a scenario is rebuilt); ``full=True`` rebuilds every scenario.
An incremental analysis writes into a copy of the previous DB: a carried scenario's rows stay as
they are, and a continued ledger writes only its new rows.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, closing, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import polars as pl

from kvlens.analysis_db import build_analysis_db
from kvlens.analyzers import incremental
from kvlens.commit import tmp_name
from kvlens.compact import merged_segments
from kvlens.errors import ConfigError, NoDataError
from kvlens.models import DEFAULT_MODEL, ModelGeometry, get_model, group_bytes_per_token

if TYPE_CHECKING:
    from kvlens.analyzers import LedgerPlan
    from kvlens.analyzers.out_of_core import OutOfCore
    from kvlens.analyzers.partitions import Partitions

__all__ = ["AnalyzeResult", "analyze_lake", "scenario_model"]

log = logging.getLogger(__name__)

SCENARIOS_SQL = "SELECT DISTINCT scenario FROM requests ORDER BY 1"
SCENARIO_MODELS_SQL = ("SELECT model FROM requests WHERE scenario = ? AND model IS NOT NULL "
                       "GROUP BY model ORDER BY count(*) DESC")

# Wraps the chosen scenarios for display (the CLI's progress bar); entered once around the loop.
Progress = Callable[[list[str]], AbstractContextManager[Iterable[str]]]


@dataclass(frozen=True)
class AnalyzeResult:
    """The DB written and, per scenario analyzed, the model its bytes assume and where it came from."""

    db: Path
    scenarios: tuple[str, ...]
    models: tuple[tuple[str, str, str], ...]  # (scenario, model name, given | requests | default)
    modes: tuple[tuple[str, str, str], ...] = ()  # (scenario, full | carried | appended, why)


def scenario_model(con: duckdb.DuckDBPyConnection, scenario: str,
                   given: ModelGeometry | None = None) -> tuple[ModelGeometry, str]:
    """(geometry, source) of a scenario: ``given`` (``given``), else its requests' most common known
    model (``requests``), else the default, assumed (``default``)."""
    if given is not None:
        return given, "given"
    names = con.execute(SCENARIO_MODELS_SQL, [scenario]).fetchall()
    for (name,) in names:
        try:
            return get_model(name), "requests"
        except ConfigError:
            continue
    said = f"model {names[0][0]} unknown" if names else "no model on its requests"
    log.warning("scenario %s: %s, bytes assume %s; pass --model or --model-config config.json",
                scenario, said, DEFAULT_MODEL)
    return get_model(DEFAULT_MODEL), "default"


def analyze_lake(lake: str | os.PathLike[str], db: str | os.PathLike[str], scenarios: Sequence[str] = (),
                 model: ModelGeometry | None = None, *, cache_tokens: int | None = None,
                 join: Sequence[str] = (), metrics_from: str | None = None,
                 progress: Progress | None = None, full: bool = False,
                 partitions: Partitions | None = None, memory_limit: int | None = None,
                 out_of_core: OutOfCore | None = None) -> AnalyzeResult:
    """(Re)build ``db`` from ``lake``: every analysis of each of ``scenarios`` (default: all but the
    ``join`` sources), with ``model`` or each scenario's own (``scenario_model``). A scenario whose
    inputs are those the previous ``db`` recorded is copied from it unless ``full``. ``partitions``:
    replay each analyzed scenario's ledger in block-hash partitions (analyzers/partitions.py), in
    this process or on Ray; the outcomes are the same. ``memory_limit``: the bytes this analysis may
    hold (``kvlens analyze --memory-limit`` keeps it: kvlens/memory.py); DuckDB gets half, and spills
    past it. ``out_of_core``: compute each scenario's ledger alone with bounded memory, spilling to a
    directory beside ``db`` (analyzers/out_of_core.py); every scenario is rebuilt and saves no
    incremental state."""
    from kvlens.analyzers import LedgerPlan, analyze_scenario

    if out_of_core is not None:
        given = [flag for flag, on in (("--join", join),) if on]
        if given:
            raise ConfigError(f"{', '.join(given)} cannot go with --out-of-core: joining other scenarios' "
                              "requests by id is not built out of core; drop "
                              f"{'them' if len(given) > 1 else 'it'}, or analyze without --out-of-core")
        return _out_of_core(lake, db, scenarios, model, progress, memory_limit, out_of_core,
                            metrics_from=metrics_from, cache_tokens=cache_tokens, runner=partitions)

    done: list[str] = []
    models: list[tuple[str, str, str]] = []
    modes: list[tuple[str, str, str]] = []
    segments = incremental.snapshot(lake)
    merged = merged_segments(lake)
    previous = Path(db).resolve()
    code = incremental.code_digest()
    candidate = None if full else incremental.base_file(previous)
    base: Path | None = None  # set when the copy of ``candidate`` fits (``accepted``)

    def accepted(con: duckdb.DuckDBPyConnection) -> bool:
        nonlocal base
        base = candidate if incremental.base_fits(con, code) else None
        return base is not None

    def compute(con: duckdb.DuckDBPyConnection) -> Iterator[tuple[str, pl.DataFrame]]:
        chosen = _chosen(con, lake, scenarios, join)
        state = incremental.previous_state(con, previous) if not full else "--full given"
        no_state, before = (state, {}) if isinstance(state, str) else (None, state)
        wrapped: AbstractContextManager[Any] = progress(chosen) if progress else nullcontext(chosen)
        worker = incremental.StateWorker()
        with wrapped as each, closing(worker):
            for scenario in each:
                # One transaction per scenario (from here no statement is expected to fail): a
                # statement that commits on its own writes its rows to the write-ahead log, and the
                # CHECKPOINT writes them again; one for every scenario would hold them all in memory.
                con.execute("BEGIN TRANSACTION")
                geometry, source = scenario_model(con, scenario, model)
                config = incremental.config_of(geometry, source, cache_tokens=cache_tokens, join=join,
                                               metrics_from=metrics_from, code=code)
                now = incremental.scenario_inputs(lake, segments, scenario, config, join=join,
                                                  metrics_from=metrics_from, known=before.get(scenario),
                                                  merged=merged)
                decision = incremental.decide(now, before.get(scenario), full=full, no_state=no_state)
                log.info("scenario %s: %s (%s)", scenario, decision.mode, decision.reason)
                edge = incremental.horizon(now, before.get(scenario) if decision.mode != "full" else None)
                if decision.mode == "carried":
                    if base is not None:
                        incremental.keep_scenario(con, scenario)
                    else:
                        incremental.carry_scenario(con, scenario)
                else:
                    appended = decision.mode == "appended"
                    plan = LedgerPlan(edge,
                                      incremental.resume_of(con, scenario, worker) if appended else None,
                                      partitions=_shown(partitions, each, scenario),
                                      flows_resume=(incremental.flows_resume_of(con, scenario, worker)
                                                    if appended else None),
                                      # reuse keeps its rows before its checkpoint where they are: in a
                                      # copy of the previous DB, and when no --join can change them
                                      reuse_resume=(incremental.reuse_resume_of(con, scenario, worker)
                                                    if appended and base is not None and not join else None),
                                      scans_resume=(incremental.scans_resume_of(con, scenario, worker)
                                                    if appended else None),
                                      keep_windows=appended and base is not None and not join,
                                      unchanged_before=(incremental.new_rows_from(
                                          now, before[scenario], scenario) if appended else {}))
                    pairs = analyze_scenario(con, scenario, geometry, cache_tokens=cache_tokens, join=join,
                                             metrics_from=metrics_from, model_source=source, ledger=plan)
                    if base is not None:
                        incremental.clear_scenario(con, scenario, keep=("block_outcomes", "reuse", "fanout"))
                        pairs = _replacing(con, scenario, pairs, plan)
                    try:
                        for pair in pairs:  # each state is packed from when it is ready, beside the analyses
                            worker.offer(plan.result.state if plan.result else None, plan.flows_state,
                                         plan.reuse_state, plan.scans_state)
                            yield pair
                    finally:  # (stopped early: the previous rows' reads end before the connection closes)
                        if plan.resume is not None:
                            plan.resume.drop()
                    decision = _ledger_said(scenario, decision, plan)
                    incremental.write_ledger(con, scenario, plan.result.state if plan.result else None,
                                             plan.flows_state, plan.reuse_state, plan.scans_state, worker)
                incremental.write_state(con, scenario, now, decision, edge)
                done.append(scenario)
                models.append((scenario, geometry.name, source))
                modes.append((scenario, decision.mode, decision.reason))
                con.execute("COMMIT")
        if base is not None:
            incremental.drop_others(con, done)
        if no_state is None:
            incremental.detach_previous(con)

    path = build_analysis_db(db, lake, compute, base=candidate, accept=accepted, memory_limit=memory_limit)
    return AnalyzeResult(path, tuple(done), tuple(models), tuple(modes))


def _chosen(con: duckdb.DuckDBPyConnection, lake: str | os.PathLike[str], scenarios: Sequence[str],
            join: Sequence[str]) -> list[str]:
    """The scenarios to analyze: ``scenarios``, or every scenario of the lake but the ``join``
    sources; NoDataError naming any that has no requests."""
    present = [r[0] for r in con.execute(SCENARIOS_SQL).fetchall()]
    chosen = list(scenarios) or [p for p in present if p not in join]
    unknown = sorted((set(chosen) | set(join)) - set(present))
    if unknown:
        raise NoDataError(f"scenario(s) {', '.join(unknown)} have no requests in lake {lake}: "
                          f"present are {', '.join(present) or 'none'}")
    return chosen


def _out_of_core(lake: str | os.PathLike[str], db: str | os.PathLike[str], scenarios: Sequence[str],
                 model: ModelGeometry | None, progress: Progress | None, memory_limit: int | None,
                 plan: OutOfCore, *, metrics_from: str | None = None,
                 cache_tokens: int | None = None, runner: Partitions | None = None) -> AnalyzeResult:
    """``analyze_lake`` out of core: each scenario's ledger (analyzers/out_of_core.py) and every
    analysis after it (``analyze_after_ledger``) in a new DB, with DuckDB's memory bounded
    (``DUCKDB_MEMORY`` when no limit is given) and the spills in a directory beside ``db`` named
    as its temporary file is (a killed run's is removed by the next build,
    ``remove_dead_leftovers``)."""
    from kvlens.analyzers import analyze_after_ledger, scenario_row
    from kvlens.analyzers.out_of_core import DUCKDB_MEMORY, OutOfCoreResult, ledger_out_of_core

    final = Path(db).resolve()
    done: list[str] = []
    models: list[tuple[str, str, str]] = []
    modes: list[tuple[str, str, str]] = []

    def compute(con: duckdb.DuckDBPyConnection) -> Iterator[tuple[str, pl.DataFrame]]:
        chosen = _chosen(con, lake, scenarios, ())
        if memory_limit is None:
            con.execute(f"SET memory_limit = '{DUCKDB_MEMORY}'")
        wrapped: AbstractContextManager[Any] = progress(chosen) if progress else nullcontext(chosen)
        with wrapped as each:
            for scenario in each:
                geometry, source = scenario_model(con, scenario, model)
                result = OutOfCoreResult()
                skipped: list[str] = []
                spill = final.with_name(tmp_name(final.name) + ".ooc")
                try:
                    say = _saying(each, scenario)
                    yield from ledger_out_of_core(
                        con, lake, scenario, spill, bytes_per_token=geometry.kv_bytes_per_token(),
                        group_bytes_per_token=group_bytes_per_token(geometry), plan=plan, result=result,
                        say=say, runner=runner)
                    t = time.perf_counter()
                    for name, frame in analyze_after_ledger(
                            con, scenario, geometry, work=spill / "after", partitions=result.partitions,
                            metrics_from=metrics_from, cache_tokens=cache_tokens, skipped=skipped):
                        t = result.timed(name, t)
                        yield name, frame
                        t = result.timed("writing the rows", t)
                        say(f"{name} written")
                    log.info("scenario %s out of core, seconds per step: %s", scenario, result.steps())
                finally:
                    shutil.rmtree(spill, ignore_errors=True)
                yield "scenarios", scenario_row(
                    con, scenario, geometry, requests=con.table("requests").filter(
                        duckdb.ColumnExpression("scenario") == duckdb.ConstantExpression(scenario)),
                    counted=result.requests, needed_blocks=result.needed_blocks, model_source=source)
                said = "; ".join([result.said(), *skipped])
                log.info("scenario %s: full (%s)", scenario, said)
                done.append(scenario)
                models.append((scenario, geometry.name, source))
                modes.append((scenario, "full", f"--out-of-core given; {said}"))

    path = build_analysis_db(db, lake, compute, memory_limit=memory_limit)
    return AnalyzeResult(path, tuple(done), tuple(models), tuple(modes))


def _saying(bar: Any, scenario: str) -> Callable[[str], object]:
    """What shows a step beside the scenario on the progress bar ("rr8: ledger partition 3/8"; a
    click bar's ``update(0, item)`` does not redraw: the item is set and the bar drawn)."""
    render = getattr(bar, "render_progress", None)

    def say(text: str) -> None:
        if render is not None:
            bar.current_item = f"{scenario}: {text}"
            render()
        log.debug("scenario %s: %s", scenario, text)

    return say


def _replacing(con: duckdb.DuckDBPyConnection, scenario: str, pairs: Iterable[tuple[str, pl.DataFrame]],
               plan: LedgerPlan) -> Iterator[tuple[str, pl.DataFrame]]:
    """``pairs`` for a copy of the previous DB whose other rows of ``scenario`` are gone: its
    ``block_outcomes`` rows go too, unless the ledger continued: then only the rows of the
    requests it replayed, and only its new rows are written; so do its ``reuse`` rows, unless
    reuse continued: then only those from its checkpoint on."""
    for name, frame in pairs:
        if name == "fanout":
            if not plan.fanout_kept:
                incremental.clear_scenario(con, scenario, tables=[name])
            elif plan.fanout_since is not None:
                incremental.delete_since(con, name, scenario, plan.fanout_since, "window_start_ns")
        elif name == "reuse":
            if plan.reuse_since is not None:
                incremental.delete_since(con, name, scenario, plan.reuse_since)
            else:
                incremental.clear_scenario(con, scenario, tables=[name])
        elif name == "block_outcomes":
            result = plan.result
            if result is not None and result.appended is not None and result.replaced is not None:
                incremental.delete_requests(con, name, scenario, result.replaced)
                frame = result.appended
            else:
                incremental.clear_scenario(con, scenario, tables=[name])
        yield name, frame


def _shown(partitions: Partitions | None, bar: Any, scenario: str) -> Partitions | None:
    """``partitions`` whose partitions, as each is gathered, show on the progress bar beside the
    scenario ("rr8: ledger partition 3/8"): a run on a cluster can take minutes per scenario. (A
    click bar's ``update(0, item)`` does not redraw: the item is set and the bar drawn.)"""
    if partitions is None or getattr(bar, "render_progress", None) is None:
        return partitions
    return partitions.saying(_saying(bar, scenario))


def _ledger_said(scenario: str, decision: incremental.Decision, plan: LedgerPlan) -> incremental.Decision:
    """The decision, its reason extended with how the ledger of an appended scenario was computed."""
    result = plan.result
    if result is None:
        return decision
    where = ""
    if plan.partitions is not None and result.partitions:
        where = f" in {result.partitions} block-hash partitions {plan.partitions.where}"
    if decision.mode != "appended" and not where:
        return decision
    if decision.mode != "appended":
        said = f"ledger replayed{where}"
    elif plan.resume is None:
        said = f"ledger replayed in full{where}: no saved state"
    elif result.refused is not None:
        said = f"ledger replayed in full{where}: {result.refused}"
    else:
        said = (f"ledger continued from its checkpoint at {plan.resume.checkpoint_ns} ns, "
                f"{result.replayed:,} requests replayed in this process")
    if decision.mode == "appended":
        said += (f"; reuse continued from its checkpoint at {plan.reuse_since} ns"
                 if plan.reuse_since is not None else
                 f"; reuse computed in full: {plan.reuse_refused or 'no saved state it can continue'}")
        said += f"; {plan.scans_said or 'lake aggregates computed in full: no saved state'}"
    log.info("scenario %s: %s", scenario, said)
    return incremental.Decision(decision.mode, f"{decision.reason}; {said}")
