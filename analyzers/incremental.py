"""analyzers' incremental step for ``kvlens analyze``: which scenarios need analyzing, and the state
that says so, kept in the analysis DB beside the results.

What "new data" is. The lake is append-only per writer: every flush adds a segment file under
``<table>/scenario=NAME/date=*/`` and never rewrites one; ``kvlens import`` / ``simulate``
replace a scenario by swapping in new segments with new names. So a scenario's inputs are named
by the set of segments it reads: its own in every lake table, those of its ``--join`` sources
and of its ``--metrics-from`` scenario, and every ``probe_runs`` segment (the cost model reads
them all). Each is recorded by path, size and modification time, with its oldest row. The
watermark of a scenario is the newest row time among its segments when it was analyzed.
``kvlens compact`` merges segments without changing their rows (kvlens/compact.py): a merged
segment's sidecar lists the segments it replaced, as recorded here, and a merged segment counts
as those (``scenario_inputs``), so a compaction between two analyses changes no input.

On the next ``kvlens analyze`` each chosen scenario is, in this order:

- ``full``: rebuilt from the lake, when ``--full`` was given, when the previous DB has no state
  (written by an older kvlens, or damaged), or when what its results depend on besides the lake
  changed: the model geometry (or where it came from), ``--cache-tokens``, ``--join``,
  ``--metrics-from``, the analysis DB's schema version or the analyzers' code (a digest of
  their source files);
- ``full`` as well when a recorded segment is gone (a re-import, a day dropped by retention, a
  merged segment whose sidecar is gone) or a new
  segment holds rows older than the previous analysis' *horizon*, its watermark less the lag
  (``late_lag``: ``LATE_LAG_NS``, or more when its live collectors' segments showed rows landing
  later, as the gateway's long requests do): a late segment; the reason is logged;
- ``carried``: its input segments are exactly those recorded: its rows are copied from the
  previous DB, unchanged (``analyzed_ns`` in ``scenarios`` keeps the time they were computed);
- ``appended``: only new segments, none late: the ledger (``block_outcomes``) continues from the
  state the previous DB saved at its checkpoint (analyzers/ledger_state.py), unless that state
  does not cover the new data (then it is replayed in full, and the reason is logged); ``flows``
  continues from its own state at the same checkpoint when the ledger did (analyzers/flows.py,
  ``FlowsState``); ``reuse`` keeps its rows stamped before its checkpoint (the horizon) and
  computes the rest from each stream's LRU stack there (analyzers/reuse.py, ``ReuseState``), in a
  copy of the previous DB and without ``--join``; the lake aggregates of tier_payoff (store
  counts), warmup (first events, clears) and isolation_findings (block sizes, salts, the least and
  greatest block hash of each content hash) continue from theirs (analyzers/scans.py,
  ``ScanState``), scanning only the rows from their checkpoint on; every other analysis is
  computed again over the whole scenario.

Where it is written. An incremental analysis starts from a copy of the previous DB (``base_fits``):
a carried scenario's rows stay where they are, an analyzed one's are deleted first, a continued
ledger deletes only its replayed requests' rows and writes its new ones, and a scenario no longer
chosen is deleted. A new file is written instead after a code change (every scenario is rebuilt
then) and when more than half the file's blocks are free (DuckDB reuses deleted rows' blocks but
never returns them: this keeps the file within about twice what it holds; measured on a lake grown
in 20 increments, 15.6 MB against 8.5 MB for a new build).

Results are identical to a full analysis by construction (tests/test_incremental.py and
tests/test_ledger_resume.py compare them).

What continuing takes, per output table. ``block_outcomes`` continues (analyzers/ledger_state.py):
the replay's residency bit masks per block row and location, copy counts, content/namespace maps
and last removals are saved as arrays at a checkpoint, with the groups each location publishes
(a location or group that starts publishing refuses the state) and the block hashes needed so far
(``reusable``), and the runs settled requests were admitted at (analyzers/admission.py's claims):
requests anchored at their own stores (a real vLLM's) are admitted over the whole stream with
those runs taken; a request that found no run of its own settles once the checkpoint is
``ADMISSION_WINDOW_NS`` (10 minutes) past its look-up. ``reuse`` continues (analyzers/reuse.py):
an LRU stack is the order of its keys' last accesses and their sizes there, so each replica and
event stream keeps those, the rows before the checkpoint stay, and a chain root that appears
later adds the group rows of its earlier re-accesses. ``request_ledger`` keeps the sums the
previous one wrote for the requests the ledger did not replay; ``fanout`` keeps its rows of the
windows before the earliest arrival among the replayed rows. Append-only per request next:
``request_sources``.

DESIGN.md section 7 computes the ledger past one machine the same way (per time window, the cache
state carried across windows), so issue 17's ledger builds on this. Mergeable aggregates:
``miss_ledger``, ``tier_payoff``, ``tier_reconciliation``, the exact ``mrc`` histogram (SHARDS
keeps its sample heap). Global, recomputed from stored rows: ``scenarios``, ``latency_tails``
(quantiles), ``warmup``, ``prefix_ranking``, ``crossover``, ``capacity``, ``reconciliation``,
``hygiene``, ``isolation_findings``, ``ttl_coverage`` (needs each access's next access). Measured
on the 4,000-request ``rr2`` lake of tests/bench/bench_incremental.py, the 6th of 6 increments of
equal rows (one in-process ``kvlens analyze`` of 1.49 s against 0.92 s for the 1st, on a machine
slower that day than the 1.10 s this paragraph said before; the ledger, flows, reuse,
request_ledger and fanout continued): the ledger and request ledger 0.28 s, flows 0.19 s (its state
keeps the latest store of every block and location: a later read may still be matched to it, so
it is as large as the blocks ever stored), reuse 0.14 s with its access stream (mrc and
ttl_coverage read the whole ``requests`` stream), isolation_findings 0.11 s (its distinct keys
read every stored event; now only when a content hash has two block hashes), tier_payoff 0.07 s,
warmup 0.06 s, prefix_ranking 0.04 s (its cost model is now asked once per distinct segment),
ttl_coverage 0.03 s; the DB's commit and checkpoint 0.13 s (0.08 s for the 1st increment's new
file). Continuing has a cost of its own, whatever the history: the 2nd increment took 1.15 s against the 1st's
0.77 s in the same minutes (the ledger's continuation 0.19 s to 0.26 s against 0.13 s for a full
replay of as many rows: its checks, the requests after the checkpoint found by a semi-join in
DuckDB, the previous rows read back; the deletes in the copy and the checkpoint). A checkpoint
rewrites each row group that appends and deletes touched, so the DB is attached with row groups of
16,384 rows (kvlens/analysis_db.py): with DuckDB's 122,880 it rewrote the big tables whole (inserts,
commit and checkpoint of a quarter of the 6th increment's block_outcomes: 108 ms, against 52 ms).
All of an analysis' writes are one transaction, the states (the ledger's too) are packed and read
back on a worker thread, and the previous DB is checked on its copy.

The state is the table ``kvlens_state`` of the analysis DB (and ``kvlens_ledger``,
``kvlens_flows``, ``kvlens_reuse`` and ``kvlens_scans``, the analyzers' own states), written in the
same file as the results (kvlens/analysis_db.py builds it under a temporary name and renames it
into place), so a kill during an analysis leaves the previous DB and its state together.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import duckdb
import polars as pl

from kvlens.analysis_db import attach_analysis_db, check_duckdb_file
from kvlens.analyzers.flows import FLOWS_TABLE, FlowsState
from kvlens.analyzers.ledger_state import LEDGER_TABLE, LedgerState
from kvlens.analyzers.outcomes import Prefetch, Resume
from kvlens.analyzers.reuse import REUSE_STATE_TABLE, ReuseState
from kvlens.analyzers.scans import SCANS_TABLE, ScanState
from kvlens.analyzers.state_blob import Pending
from kvlens.commit import wait_for_commits
from kvlens.compact import Merged, Source, source_record, unit
from kvlens.errors import ConfigError
from kvlens.lake import segment_time_range
from kvlens.models import ModelGeometry
from kvlens.schema import ANALYSIS_TABLES, LAKE_TABLES, SCHEMA_VERSION, TABLES

__all__ = ["LATE_LAG_NS", "LATE_SEEN_NS", "LIVE_WINDOW_NS", "MAX_LATE_LAG_NS", "STATE_TABLE", "Decision",
           "Inputs", "Segment", "StateWorker", "base_file", "base_fits", "carry_scenario", "clear_scenario",
           "code_digest", "decide", "delete_requests", "delete_since", "detach_previous", "drop_others",
           "flows_resume_of", "horizon", "keep_scenario", "late_lag", "new_rows_from",
           "previous_state", "resume_of", "reuse_resume_of", "scans_resume_of", "scenario_inputs", "snapshot",
           "write_ledger", "write_state"]

T = TypeVar("T")
log = logging.getLogger(__name__)

# A new segment may hold rows this much older than the watermark and still count as new data
# (collectors flush on their own clocks and intervals); older rows make it a late segment.
LATE_LAG_NS = 60 * 1_000_000_000
# Live collectors write some rows later than that: the gateway and the OTLP receiver write a
# request when it finishes, stamped with its arrival, so its row is as late as the request was long
# (and the flush after it); the scrape flushes every 60 s. A segment whose newest row is stamped
# within LIVE_WINDOW_NS of the time it was written is a live collector's (an imported trace's rows
# are stamped when its requests ran, long before), and how late its oldest row landed is seen
# (``late_lag``). The lag grows to a quarter more than the latest seen in the segments of the last
# LATE_SEEN_NS before the watermark (a one-off, say a collector's backlog after a restart, ages
# out), up to MAX_LATE_LAG_NS.
LIVE_WINDOW_NS = 10 * 60 * 1_000_000_000
LATE_SEEN_NS = 6 * 60 * 60 * 1_000_000_000
MAX_LATE_LAG_NS = 60 * 60 * 1_000_000_000
_NOTHING_NEW = 2**63 - 1  # new_rows_from's time for a table that gained no segment
STATE_TABLE = "kvlens_state"
PREVIOUS = "kvlens_prev"  # the alias the previous analysis DB is attached under
# analyzers' states, one blob per scenario each
_SAVED_STATES = (LEDGER_TABLE, FLOWS_TABLE, REUSE_STATE_TABLE, SCANS_TABLE)
_STATE_COLUMNS = ("scenario VARCHAR, config VARCHAR, segments VARCHAR, watermark_ns BIGINT, mode VARCHAR, "
                  "horizon_ns BIGINT")
_LEDGER_COLUMNS = "scenario VARCHAR, checkpoint_ns BIGINT, state BLOB"
CREATE_STATE_SQL = f"CREATE TABLE IF NOT EXISTS {STATE_TABLE} ({_STATE_COLUMNS})"
INSERT_STATE_SQL = f"INSERT INTO {STATE_TABLE} VALUES (?, ?, ?, ?, ?, ?)"
PREVIOUS_STATE_SQL = f"SELECT scenario, config, segments, horizon_ns FROM {PREVIOUS}.{STATE_TABLE}"
PREVIOUS_VERSION_SQL = f"SELECT value FROM {PREVIOUS}.kvlens_meta WHERE key = 'schema_version'"
_GLOBAL_TABLES = ("probe_runs",)  # read whole by every scenario (analyzers/costs.py)
# Tables whose time is when a record was made (a probe's run, a simulation), not when the scenario's
# traffic happened: they move no watermark and are never late (every analysis that reads them, the
# cost model's and provenance's, is computed again every run). A lake of a trace recorded last
# year and probed today would otherwise have its watermark today, and every new slice of the trace
# would be late.
_RECORD_PREFIXES = ("probe_runs/", "simulations/")
# what analyzers import from the spine (routing.py: the simulator's policies)
_CODE_FILES = ("models.py", "schema.py", "analysis_db.py", "lake.py", "query.py", "routing.py")


# One lake segment a scenario reads: its path under the lake, size, mtime, oldest and newest row.
# The record a compaction's sidecar lists the segments it replaced with (kvlens/compact.py).
Segment = Source


@dataclass(frozen=True)
class Inputs:
    """What one scenario's results depend on: the configuration (as JSON) and its segments."""

    config: str
    segments: tuple[Segment, ...]
    # the horizon the analysis of these inputs kept its states at (``horizon``), once analyzed
    horizon_ns: int | None = None
    # what ``write_state`` records, where it differs from ``segments``: a settled merged segment as
    # itself rather than the segments it replaced (``scenario_inputs``)
    recorded: tuple[Segment, ...] | None = None

    @property
    def watermark_ns(self) -> int | None:
        """The newest row time among the segments of the scenario's traffic (not of records)."""
        times = [s.newest_ns for s in self.segments
                 if s.newest_ns is not None and not s.path.startswith(_RECORD_PREFIXES)]
        return max(times) if times else None


@dataclass(frozen=True)
class Decision:
    """How a scenario is analyzed this time (``full``, ``carried`` or ``appended``) and why."""

    mode: str
    reason: str


def code_digest() -> str:
    """A digest of the analyzers' source (and the spine files their results depend on)."""
    here = Path(__file__).resolve().parent
    spine = here.parent / "kvlens" if (here.parent / "kvlens").is_dir() else here.parent
    files = sorted(here.glob("*.py")) + [spine / name for name in _CODE_FILES]
    digest = hashlib.sha256()
    for path in files:
        if path.exists():
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def config_of(model: ModelGeometry, model_source: str, *, cache_tokens: int | None, join: Sequence[str],
              metrics_from: str | None, code: str) -> str:
    """The configuration a scenario's results depend on, besides the lake, as canonical JSON."""
    return json.dumps({"model": dataclasses.asdict(model), "model_source": model_source,
                       "cache_tokens": cache_tokens, "join": list(join), "metrics_from": metrics_from,
                       "schema_version": SCHEMA_VERSION, "code": code}, sort_keys=True, default=str)


def snapshot(lake: str | os.PathLike[str]) -> dict[str, tuple[int, int]]:
    """Every committed segment of the lake now: path under the lake -> (size, mtime). Taken before
    the lake's views are bound, so a segment that lands in between is analyzed but not recorded
    (the next run sees it as new and analyzes it again) rather than recorded but not analyzed;
    and once no commit is in progress (a compaction's merged segment is never listed beside the
    segments it replaces)."""
    root = Path(lake)
    wait_for_commits(root)
    found = {}
    for table in LAKE_TABLES:
        for path in sorted((root / table.name).glob("**/*.parquet")):
            if not path.name.startswith("."):
                st = path.stat()
                found[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return found


def scenario_inputs(lake: str | os.PathLike[str], segments: dict[str, tuple[int, int]], scenario: str,
                    config: str, *, join: Sequence[str], metrics_from: str | None,
                    known: Inputs | None = None, merged: Mapping[str, Merged] | None = None) -> Inputs:
    """The segments of ``segments`` (a ``snapshot``) that ``scenario`` reads, with their row times
    (from ``known`` where the same file was seen before, else from its Parquet statistics). A
    merged segment of ``merged`` (kvlens/compact.py: a compaction's, with the segments it replaced)
    is read as the segments it replaced, as they were recorded (a merged one among them as itself
    where ``known`` recorded it so, else as its own): the same rows, so a compaction between two
    analyses changes none of the inputs the next one compares.

    What is recorded for the next analysis (``recorded``) lists a merged segment as itself
    (compact.unit) once it is settled: a closed day's, or one whose newest row is older than the
    watermark less ``LATE_SEEN_NS`` (``late_lag`` reads only newer segments' write times); from then
    on it is read so, its sidecar unread. A scenario's record is then a few segments per writer and
    day, plus the last hours' flushes, not one per flush the lake keeps."""
    read = {scenario, *join} | ({metrics_from} if metrics_from else set())
    seen = {s.path: s for s in known.segments} if known else {}
    merged = merged or {}
    picked: list[Segment] = []
    # per segment: its records, or (its record as itself, its sidecar's) when recorded below
    items: list[list[Segment] | tuple[Segment, Merged]] = []
    for table in LAKE_TABLES:
        prefixes = ([f"{table.name}/"] if table.name in _GLOBAL_TABLES
                    else [f"{table.name}/scenario={s}/" for s in sorted(read)])
        for path, (size, mtime) in segments.items():
            if not path.startswith(tuple(prefixes)):
                continue
            old = seen.get(path)  # (a merged segment takes the name of the newest it replaced)
            same = old is not None and (old.size, old.mtime_ns) == (size, mtime)
            if old is not None and same and (old.merged or path not in merged):
                picked.append(old)
                items.append([old])
                continue
            replaced = merged.get(path)
            if replaced is not None and replaced.size == size:
                picked.extend(_as_known(replaced, seen))
                items.append((unit(path, size, mtime, replaced.sources), replaced))
                continue
            oldest, newest = segment_time_range(Path(lake) / path, table.time_column)
            picked.append(Segment(path, size, mtime, oldest, newest))
            items.append([picked[-1]])
    now = Inputs(config, tuple(picked))
    cutoff = None if now.watermark_ns is None else now.watermark_ns - LATE_SEEN_NS
    recorded: list[Segment] = []
    for item in items:
        if isinstance(item, list):
            recorded.extend(item)
        else:
            itself, replaced = item
            recorded.extend([itself] if replaced.closed or _settled(itself, cutoff)
                            else _as_known(replaced, seen, settle=True, cutoff=cutoff))
    return now if recorded == picked else dataclasses.replace(now, recorded=tuple(recorded))


def _known_unit(source: Segment, seen: Mapping[str, Segment]) -> Segment | None:
    old = seen.get(source.path)
    same = old is not None and (old.size, old.mtime_ns) == (source.size, source.mtime_ns)
    return old if old is not None and old.merged and same else None


def _settled(source: Segment, cutoff: int | None) -> bool:
    return cutoff is not None and source.newest_ns is not None and source.newest_ns < cutoff


def _as_known(replaced: Merged, seen: Mapping[str, Segment], *, settle: bool = False,
              cutoff: int | None = None) -> list[Segment]:
    """The segments a merged segment replaced, each merged one as itself where ``seen`` recorded
    it so (or, with ``settle``, where it is settled: ``scenario_inputs``), else as the segments it
    replaced in turn."""
    out: list[Segment] = []
    for source, nested in zip(replaced.sources, replaced.inner(), strict=True):
        if nested is None:
            out.append(source)
            continue
        itself = _known_unit(source, seen)
        if itself is None and settle and (nested.closed or _settled(source, cutoff)):
            itself = source
        out.extend([itself] if itself is not None else _as_known(nested, seen, settle=settle, cutoff=cutoff))
    return out


def previous_state(con: duckdb.DuckDBPyConnection, db: Path) -> dict[str, Inputs] | str:
    """Attach the previous analysis DB as ``kvlens_prev`` and read its state; a str says why
    there is none (nothing is attached then)."""
    if not db.exists():
        return "no previous analysis DB"
    try:
        attach_analysis_db(con, db, PREVIOUS)
    except ConfigError as e:
        return f"previous analysis DB unreadable ({e})"
    try:
        version = con.execute(PREVIOUS_VERSION_SQL).fetchall()
        if version != [(str(SCHEMA_VERSION),)]:
            raise LookupError(f"previous analysis DB has schema version {version[0][0] if version else '?'}")
        rows = con.execute(PREVIOUS_STATE_SQL).fetchall()
    except (duckdb.Error, LookupError) as e:
        con.execute(f"DETACH {PREVIOUS}")
        said = str(e).splitlines()[0] if isinstance(e, LookupError) else "previous analysis DB has no state"
        return said
    state = {}
    for scenario, config, segments, edge in rows:
        state[scenario] = Inputs(config, tuple(Segment(**s) for s in json.loads(segments)),
                                 None if edge is None else int(edge))
    return state


def decide(now: Inputs, before: Inputs | None, *, full: bool, no_state: str | None) -> Decision:
    """How to analyze a scenario whose inputs are ``now``, given those of the previous run."""
    if full:
        return Decision("full", "--full given")
    if no_state is not None:
        return Decision("full", no_state)
    if before is None:
        return Decision("full", "not in the previous analysis DB")
    if now.config != before.config:
        old, new = json.loads(before.config), json.loads(now.config)
        changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        return Decision("full", f"{', '.join(changed)} changed since the previous analysis")
    current = {s.path: s for s in now.segments}
    gone = [s.path for s in before.segments if current.get(s.path) != s]
    if gone:
        return Decision("full", f"{len(gone)} segment(s) analyzed before are gone or rewritten, "
                                f"e.g. {gone[0]}")
    known = {s.path for s in before.segments}
    new = [s for s in now.segments if s.path not in known]
    if not new:
        return Decision("carried", "no new segments")
    mark = before.watermark_ns
    edge = before.horizon_ns if before.horizon_ns is not None else horizon(before)
    late = [s for s in new if edge is not None and s.oldest_ns is not None and s.oldest_ns < edge
            and not s.path.startswith(_RECORD_PREFIXES)]
    if late:
        return Decision("full", f"late segment {late[0].path}: its oldest row ({late[0].oldest_ns} ns) is "
                                f"older than the previous analysis' horizon {edge} ns (its watermark "
                                f"{mark} ns less the lag)")
    lag = late_lag(now)
    longer = (f"; rows up to {lag / 1e9:,.0f} s late accepted from now on (a quarter more than the latest "
              "a live collector's rows landed)" if lag > LATE_LAG_NS else "")
    return Decision("appended", f"{len(new)} new segment(s) after the watermark {mark} ns{longer}")


def carry_scenario(con: duckdb.DuckDBPyConnection, scenario: str) -> int:
    """Copy ``scenario``'s rows of every analysis table from the attached previous DB; rows copied."""
    copied = 0
    for table in TABLES.values():
        if table.kind != "analysis":
            continue
        cols = ", ".join(table.names)
        ((n,),) = con.execute(f"SELECT count(*) FROM {PREVIOUS}.{table.name} WHERE scenario = ?",
                              [scenario]).fetchall()
        if n:
            con.execute(f"INSERT INTO {table.name} ({cols}) SELECT {cols} FROM {PREVIOUS}.{table.name} "
                        "WHERE scenario = ?", [scenario])
            copied += n
    write_ledger(con, scenario, None)
    # (a previous DB without ledger states: the next appended analysis replays the ledger in full)
    for saved in _SAVED_STATES:
        if _previous_has(con, saved):
            con.execute(f"INSERT INTO {saved} SELECT * FROM {PREVIOUS}.{saved} WHERE scenario = ?",
                        [scenario])
    return copied


def _previous_has(con: duckdb.DuckDBPyConnection, table: str) -> bool:
    """Whether the attached previous DB has ``table`` (asked, not tried: a failed statement would
    abort the analysis' transaction)."""
    return bool(con.execute("SELECT count(*) FROM duckdb_tables() WHERE database_name = ? AND table_name = ?",
                            [PREVIOUS, table]).fetchall()[0][0])


def new_rows_from(now: Inputs, before: Inputs, scenario: str) -> dict[str, int]:
    """Per lake table of ``scenario``: a time at or after which every row is stamped that its
    segments gained since ``before`` (the analysis that saved the states an appended run continues
    from), from the new segments' oldest rows. Before that time the table holds the rows it held
    then (``decide``: every segment of ``before`` is there unchanged), so a count of the rows
    stamped before a state's checkpoint at or before it is still the state's, and needs no scan.
    A table with a new segment of unknown oldest row is left out (its counts are scanned); one
    with no new segment gets the largest time. (A segment that lands while the analysis runs is
    read but not recorded here: should it hold rows older than a checkpoint, the next run finds
    it late, older than that run's horizon, and rebuilds.)"""
    known = {s.path for s in before.segments}
    out: dict[str, int] = {}
    for table in LAKE_TABLES:
        prefix = f"{table.name}/scenario={scenario}/"
        new = [s.oldest_ns for s in now.segments if s.path.startswith(prefix) and s.path not in known]
        if all(t is not None for t in new):
            out[table.name] = min((t for t in new if t is not None), default=_NOTHING_NEW)
    return out


def late_lag(inputs: Inputs) -> int:
    """How much older than the watermark a new segment's rows may be: ``LATE_LAG_NS``, or a
    quarter more than the latest any live collector's segment among ``inputs`` landed (its write
    time less its oldest row: a request as long as it ran, the scrape's flush interval) of those
    whose newest row is within ``LATE_SEEN_NS`` of the watermark, up to ``MAX_LATE_LAG_NS``. The
    lag may shrink or grow between two analyses: ``horizon`` keeps a continuation's horizon from
    moving back, and records it for ``decide``'s late rule."""
    mark = inputs.watermark_ns
    seen = [s.mtime_ns - s.oldest_ns for s in inputs.segments
            if s.oldest_ns is not None and s.newest_ns is not None and mark is not None
            and not s.path.startswith(_RECORD_PREFIXES) and not s.merged  # (its mtime is its merge's)
            and abs(s.mtime_ns - s.newest_ns) <= LIVE_WINDOW_NS and s.newest_ns >= mark - LATE_SEEN_NS]
    return min(max([LATE_LAG_NS, *(late + late // 4 for late in seen)]), MAX_LATE_LAG_NS)


def horizon(inputs: Inputs, before: Inputs | None = None) -> int | None:
    """The time before which no row of the scenario can still arrive without a full rebuild: the
    watermark less ``late_lag`` (``decide`` rebuilds on a segment older than that). ``before``: the
    inputs a continuation starts from; the horizon is never before theirs (a lag that grew, say a
    long request seen for the first time, would move it back, before the states the previous
    analysis settled requests at), and is recorded (``write_state``) for the next ``decide``."""
    mark = inputs.watermark_ns
    edge = None if mark is None else mark - late_lag(inputs)
    if before is not None and before.horizon_ns is not None:
        edge = before.horizon_ns if edge is None else max(edge, before.horizon_ns)
    return edge


def _saved_at(con: duckdb.DuckDBPyConnection, table: str, scenario: str) -> tuple[int | None] | None:
    """(checkpoint,) of the one state the previous analysis DB saved for ``scenario`` in ``table``,
    if any: its blob unread (a column of its own: DuckDB reads no byte of it here)."""
    if not _previous_has(con, table):
        return None
    rows = con.execute(f"SELECT checkpoint_ns, state IS NOT NULL FROM {PREVIOUS}.{table} WHERE scenario = ?",
                       [scenario]).fetchall()
    return (rows[0][0],) if len(rows) == 1 and rows[0][1] else None


def _blob(con: duckdb.DuckDBPyConnection, table: str, scenario: str) -> bytes | None:
    """The state blob itself (its checkpoint is ``_saved_at``'s)."""
    rows = con.execute(f"SELECT state FROM {PREVIOUS}.{table} WHERE scenario = ?", [scenario]).fetchall()
    return rows[0][0] if len(rows) == 1 else None


def _state_of(con: duckdb.DuckDBPyConnection, table: str, scenario: str, parse: Callable[[bytes], T],
              what: str, instead: str, worker: StateWorker | None = None) -> Pending[T]:
    """The state blob the previous analysis DB saved for ``scenario`` in ``table``, parsed (read
    and parsed on ``worker``'s thread when given, over a cursor of its own: the blobs grow with the
    lake's age, on the whole sample trace's 6th increment four of them, 6 MB, read in 23 ms); None
    when there is none, or when it does not read (logged, naming ``what`` it is and what is done
    ``instead``)."""
    if _saved_at(con, table, scenario) is None:
        return None
    return _fetched_later(con, table, scenario, parse, what, instead, worker)


def _fetched_later(con: duckdb.DuckDBPyConnection, table: str, scenario: str, parse: Callable[[bytes], T],
                   what: str, instead: str, worker: StateWorker | None) -> Pending[T]:
    """``_state_of`` for a state its caller found saved (``_saved_at``): not looked for again."""
    if worker is None:
        return _read(_blob(con, table, scenario), parse, scenario, what, instead, None)
    return worker.later(_fetched, con.cursor(), table, scenario, parse, what, instead)


def _fetched(cursor: duckdb.DuckDBPyConnection, table: str, scenario: str, parse: Callable[[bytes], T],
             what: str, instead: str) -> T | None:
    """``_state_of``'s read on the worker: the blob over ``cursor`` (closed here), then parsed."""
    try:
        blob = _blob(cursor, table, scenario)
    finally:
        cursor.close()
    return None if blob is None else _parsed(blob, parse, scenario, what, instead)


def _read(blob: bytes | None, parse: Callable[[bytes], T], scenario: str, what: str, instead: str,
          worker: StateWorker | None) -> Pending[T]:
    if blob is None:
        return None
    if worker is not None:
        return worker.later(_parsed, blob, parse, scenario, what, instead)
    return _parsed(blob, parse, scenario, what, instead)


def _parsed(blob: bytes, parse: Callable[[bytes], T], scenario: str, what: str, instead: str) -> T | None:
    try:
        return parse(blob)
    except (ValueError, KeyError, TypeError, OSError, pl.exceptions.PolarsError) as e:
        log.warning("scenario %s: the saved %s state is unreadable (%s); %s", scenario, what, e, instead)
        return None


def resume_of(con: duckdb.DuckDBPyConnection, scenario: str,
              worker: StateWorker | None = None) -> Resume | None:
    """The ledger state the previous analysis DB saved for ``scenario`` and its ledger rows, if any;
    the state is parsed on ``worker``'s thread when given (the ledger needs only its checkpoint
    until it has read the new requests), and a state that does not read replays the ledger in
    full."""
    saved = _saved_at(con, LEDGER_TABLE, scenario)
    if saved is None:
        return None
    (saved_at,) = saved
    state = _fetched_later(con, LEDGER_TABLE, scenario, LedgerState.from_bytes, "ledger",
                           "replaying its ledger in full", worker)
    # The previous rows grow with the lake's age and are needed only after the replay: they are
    # read while it runs (outcomes.Prefetch).
    return Resume(state, Prefetch(con, f"{PREVIOUS}.block_outcomes", scenario),
                  Prefetch(con, f"{PREVIOUS}.request_ledger", scenario),
                  saved_at=int(saved_at) if saved_at is not None else None)


class _Saved(Protocol):
    @property
    def checkpoint_ns(self) -> int: ...

    def to_bytes(self) -> bytes: ...


class StateWorker:
    """The analyzers' states packed (``to_bytes``: compression, mostly outside the GIL) on one
    worker thread from the moment each is ready, while the analyses after it run; ``write_ledger``
    takes the bytes. The previous states are read back there too (``later``), while the ledger
    runs. ``close`` waits for the worker (a state not yet packed is dropped)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvlens-states")
        self._jobs: dict[int, tuple[_Saved, Future[bytes]]] = {}

    def later(self, fn: Callable[..., T | None], *args: Any) -> Future[T | None]:
        return self._pool.submit(fn, *args)

    def offer(self, *states: _Saved | None) -> None:
        for state in states:
            if state is not None and id(state) not in self._jobs:
                self._jobs[id(state)] = (state, self._pool.submit(state.to_bytes))

    def bytes_of(self, state: _Saved) -> bytes:
        job = self._jobs.get(id(state))
        return job[1].result() if job is not None and job[0] is state else state.to_bytes()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def write_ledger(con: duckdb.DuckDBPyConnection, scenario: str, state: LedgerState | None,
                 flows: FlowsState | None = None, reuse: ReuseState | None = None,
                 scans: ScanState | None = None, worker: StateWorker | None = None) -> None:
    """Record the scenario's ledger state, and flows', reuse's and the lake aggregates' beside it,
    in the DB being built (``carry_scenario`` copies them); ``worker``: where they were packed."""
    for table, saved in ((LEDGER_TABLE, state), (FLOWS_TABLE, flows), (REUSE_STATE_TABLE, reuse),
                         (SCANS_TABLE, scans)):
        con.execute(f"CREATE TABLE IF NOT EXISTS {table} ({_LEDGER_COLUMNS})")
        if saved is not None:
            data = worker.bytes_of(saved) if worker is not None else saved.to_bytes()
            con.execute(f"INSERT INTO {table} VALUES (?, ?, ?)", [scenario, saved.checkpoint_ns, data])


def flows_resume_of(con: duckdb.DuckDBPyConnection, scenario: str,
                    worker: StateWorker | None = None) -> Pending[FlowsState]:
    """flows' state the previous analysis DB saved for ``scenario``, if any (and readable); read
    on ``worker``'s thread when given."""
    return _state_of(con, FLOWS_TABLE, scenario, FlowsState.from_bytes, "flows",
                     "computing its flows in full", worker)


def reuse_resume_of(con: duckdb.DuckDBPyConnection, scenario: str,
                    worker: StateWorker | None = None) -> Pending[ReuseState]:
    """reuse's state the previous analysis DB saved for ``scenario``, if any (and readable), with
    the count of its `reuse` rows before the state's checkpoint (they stay in the DB); read on
    ``worker``'s thread when given."""
    saved = _saved_at(con, REUSE_STATE_TABLE, scenario)
    if saved is None:
        return None
    (at,) = saved
    ((kept,),) = con.execute(f"SELECT count(*) FROM {PREVIOUS}.reuse WHERE scenario = ? AND ts_ns < ?",
                             [scenario, at]).fetchall()

    def parse(data: bytes) -> ReuseState:
        return dataclasses.replace(ReuseState.from_bytes(data), kept_rows=int(kept))

    return _fetched_later(con, REUSE_STATE_TABLE, scenario, parse, "reuse", "computing reuse in full", worker)


def scans_resume_of(con: duckdb.DuckDBPyConnection, scenario: str,
                    worker: StateWorker | None = None) -> Pending[ScanState]:
    """The lake aggregates' state the previous analysis DB saved for ``scenario``, if readable; read
    on ``worker``'s thread when given."""
    return _state_of(con, SCANS_TABLE, scenario, ScanState.from_bytes, "lake aggregates",
                     "computing them in full", worker)


def detach_previous(con: duckdb.DuckDBPyConnection) -> None:
    """Detach the previous analysis DB (before the new one is renamed over it)."""
    con.execute(f"DETACH {PREVIOUS}")


def write_state(con: duckdb.DuckDBPyConnection, scenario: str, inputs: Inputs, decision: Decision,
                edge: int | None) -> None:
    """Record what ``scenario`` was analyzed from, and the horizon ``edge`` its states were kept at,
    in the DB being built (committed with it)."""
    con.execute(CREATE_STATE_SQL)
    listed = inputs.segments if inputs.recorded is None else inputs.recorded
    segments = json.dumps([source_record(s) for s in listed])
    con.execute(INSERT_STATE_SQL,
                [scenario, inputs.config, segments, inputs.watermark_ns, decision.mode, edge])


# -- appending to a copy of the previous DB --------------------------------------------------------
#
# An incremental analysis starts from a copy of the previous analysis DB (``base_fits``) rather than
# an empty file: a carried scenario's rows are already there, an analyzed scenario's are deleted
# first (``clear_scenario``), and a continued ledger deletes only the replayed requests' rows and
# inserts its new ones (``delete_requests``). What the DB holds is what a fresh build writes.


_BLOCKS_SQL = ("SELECT used_blocks, free_blocks FROM pragma_database_size() "
               "WHERE database_name = current_database()")


def _scoped_tables() -> list[str]:
    """Every table of the analysis DB that holds rows per scenario."""
    return [t.name for t in ANALYSIS_TABLES] + [STATE_TABLE, *_SAVED_STATES]


def base_file(db: str | os.PathLike[str]) -> Path | None:
    """``db`` when it may be the copy an incremental analysis starts from: a DuckDB file with no
    write-ahead log beside it (``base_fits`` then checks what it holds, on the copy)."""
    path = Path(db).resolve()
    if not path.is_file() or path.with_name(path.name + ".wal").exists():
        return None
    try:
        check_duckdb_file(path)
    except ConfigError:
        return None
    return path


def base_fits(con: duckdb.DuckDBPyConnection, code: str) -> bool:
    """Whether the analysis DB open as ``con``'s main database can be the copy an incremental
    analysis starts from: of this schema version, with every table and the incremental state of a
    scenario analyzed by this code (``code_digest``), and no more free blocks than used ones. When
    it cannot, the analysis builds a new file (after a code change every scenario is rebuilt; a new
    file holds no deleted rows, so the DB stays within about twice what it holds)."""
    try:
        version = con.execute("SELECT value FROM kvlens_meta WHERE key = 'schema_version'").fetchall()
        names = {r[0] for r in con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database()").fetchall()}
        configs = [r[0] for r in con.execute(f"SELECT config FROM {STATE_TABLE}").fetchall()]
        ((used, free),) = con.execute(_BLOCKS_SQL).fetchall()
    except duckdb.Error:
        return False
    if version != [(str(SCHEMA_VERSION),)] or not set(_scoped_tables()) <= names:
        return False
    if free > used:  # deleted rows' blocks are reused, never returned: a new file compacts it
        log.info("analysis DB: %d of its %d blocks are free; writing a new file", free, used + free)
        return False
    return any(json.loads(c).get("code") == code for c in configs)


def clear_scenario(con: duckdb.DuckDBPyConnection, scenario: str, *, tables: Sequence[str] | None = None,
                   keep: Sequence[str] = ()) -> None:
    """Delete ``scenario``'s rows from ``tables`` (default: every table of the DB being built)
    but ``keep``."""
    for name in tables if tables is not None else _scoped_tables():
        if name not in keep:
            con.execute(f"DELETE FROM {name} WHERE scenario = ?", [scenario])


def keep_scenario(con: duckdb.DuckDBPyConnection, scenario: str) -> None:
    """A carried scenario in a copy of the previous DB: its rows stay; only its state row is
    written again (``write_state``)."""
    con.execute(f"DELETE FROM {STATE_TABLE} WHERE scenario = ?", [scenario])


def delete_since(con: duckdb.DuckDBPyConnection, table: str, scenario: str, since_ns: int,
                 column: str = "ts_ns") -> None:
    """Delete the rows of ``scenario`` from ``table`` stamped (``column``) from ``since_ns`` on, and
    unstamped ones."""
    con.execute(f"DELETE FROM {table} WHERE scenario = ? AND ({column} >= ? OR {column} IS NULL)",
                [scenario, since_ns])


def delete_requests(con: duckdb.DuckDBPyConnection, table: str, scenario: str,
                    request_ids: pl.Series) -> None:
    """Delete the rows of ``request_ids`` of ``scenario`` from ``table``."""
    con.register("_replaced", pl.DataFrame({"request_id": request_ids}).unique())
    try:
        con.execute(f"DELETE FROM {table} WHERE scenario = ? "
                    "AND request_id IN (SELECT request_id FROM _replaced)", [scenario])
    finally:
        con.unregister("_replaced")


def drop_others(con: duckdb.DuckDBPyConnection, scenarios: Sequence[str]) -> None:
    """Delete every scenario's rows but those of ``scenarios`` (the ones analyzed or carried now).

    A DB this module writes holds rows only of scenarios with a state row (``write_state``; the
    others' went with theirs): when no other scenario has one, there is nothing to delete."""
    ((others,),) = con.execute(f"SELECT count(*) FROM {STATE_TABLE} WHERE NOT list_contains(?::VARCHAR[], "
                               "scenario)", [list(scenarios)]).fetchall()
    if not others:
        return
    for name in _scoped_tables():
        con.execute(f"DELETE FROM {name} WHERE NOT list_contains(?::VARCHAR[], scenario)", [list(scenarios)])
