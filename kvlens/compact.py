"""The spine's compaction and retention: each writer's segments of each closed day merged into one,
its small segments of the current day too (``current=True``, ``kvlens compact --today``), and raw
days past the retention dropped, each change committed under the commit journal
(kvlens/commit.py).

Why the current day too. Live collectors flush often (KV events every 5 s, the gateway every
second), one segment per flush, table and date, and every query of an analysis opens every
segment its scan may need: measured on the whole sample trace cut into 6 increments of 40
segments per table each (961 segments), the 6th increment's incremental analysis took 2.7 s
against 1.2 s for the 1st (2.2x; one segment per increment: about 1.45x). So ``kvlens
analyze --compact`` (which ``kvlens serve`` runs every period) first merges, per partition and
writer, the writer's newest segments while they add up to at most ``TARGET_BYTES`` (less those
older ones that outweigh the rest: ``_current_runs``): a writer's day becomes a few files.

What a merge keeps. The merged segment takes the name and the metadata (the writer's checkpoint)
of the newest segment it replaces, and its rows are the segments' rows in name order: the rows
a scan of the partition returns come in the order they did (a writer's segments sort together,
by time, and are merged as a run of them), and ``latest_checkpoint`` finds what it found. Beside
it a hidden sidecar (``.<name>.sources``) lists the segments it replaced, each as the analysis'
incremental state records a segment (path under the lake, size, modification time, oldest and
newest row time): ``kvlens analyze`` reads a merged segment as those segments
(analyzers/incremental.py), so a compaction neither rebuilds the analysis nor changes a row of
it. A merged segment that is merged again is listed in the new sidecar as itself (``unit``: its
path, size, mtime and its rows' times), its own sidecar's record nested in it. An analysis
records a merged segment as itself once its rows are settled (a closed day's, or older than the
window whose write times the late lag reads: analyzers/incremental.py), and finds it so in a
later merge: what a scenario's state lists stays a few records per day and writer, plus the
last hours' flushes, not every flush the lake keeps (a gateway flushing every second: 86,400 a
day, and the state is written and read back by every analysis).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import fcntl
import json
import logging
import os
import re
import shutil
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from kvlens.commit import STAGING, staging_token, swap_in
from kvlens.damage import read_segment, segment_schema
from kvlens.errors import ConfigError
from kvlens.lake import lake_info, segment_time_range, segment_writer
from kvlens.schema import LAKE_TABLES, Table, arrow_schema

__all__ = ["TARGET_BYTES", "Merged", "MergedSegments", "Source", "compact", "drop_old_days",
           "merged_segments", "parse_keep_days", "sidecar", "source_record", "unit"]

log = logging.getLogger(__name__)

# The current day's merges stop at this size: a writer's day is a few files of about this size,
# and a merge rewrites at most this much of it.
TARGET_BYTES = 64 * 1024 * 1024
# 2: a merged source is listed as itself (``unit``) with its own sidecar's record nested in it;
# 1 (still read): every original segment, flattened.
_SIDECAR_VERSION = 2


@dataclass(frozen=True)
class Source:
    """One lake segment: its path under the lake, size, mtime, oldest and newest row time; what
    analyzers/incremental.py records a scenario's inputs as (its ``Segment``), and what a merged
    segment's sidecar lists the segments it replaced as."""

    path: str  # under the lake
    size: int
    mtime_ns: int
    oldest_ns: int | None
    newest_ns: int | None
    # A merged segment recorded as itself (``unit``): its oldest and newest row are its sources', and
    # its modification time is the merge's, not when a collector wrote its rows.
    merged: bool = False


def source_record(source: Source) -> dict[str, object]:
    """``source`` as JSON (a sidecar's, an analysis state's): without ``merged`` unless set, as
    most are not (a state lists every segment a scenario reads)."""
    record = asdict(source)
    if not source.merged:
        del record["merged"]
    return record


@dataclass(frozen=True)
class Merged:
    """A merged segment's sidecar: its own size (a sidecar of another file is ignored), the
    segments it replaced, in name order (a merged one as itself, ``unit``, with its own record in
    ``within``; None for the others), and whether it merged a closed day (``closed``)."""

    size: int
    sources: tuple[Source, ...]
    closed: bool = False
    within: tuple[Merged | None, ...] = ()

    def inner(self) -> tuple[Merged | None, ...]:
        """``within``, one per source (all None: a version-1 sidecar's flattened originals)."""
        return self.within or (None,) * len(self.sources)

    def originals(self) -> list[Source]:
        """The original segments (each a collector's flush) its rows came from, in order."""
        out: list[Source] = []
        for source, nested in zip(self.sources, self.inner(), strict=True):
            out.extend([source] if nested is None else nested.originals())
        return out


def _merged_record(merged: Merged) -> dict[str, object]:
    return {"size": merged.size, "closed": merged.closed,
            "sources": [{**source_record(s), **({"within": _merged_record(m)} if m is not None else {})}
                        for s, m in zip(merged.sources, merged.inner(), strict=True)]}


def _merged_of(record: dict[str, Any]) -> Merged:
    sources, within = [], []
    for entry in record["sources"]:
        nested = entry.pop("within", None)
        sources.append(Source(**entry))
        within.append(None if nested is None else _merged_of(nested))
    return Merged(int(record["size"]), tuple(sources), bool(record.get("closed", False)),
                  tuple(within) if any(m is not None for m in within) else ())


def unit(path: str, size: int, mtime_ns: int, sources: Iterable[Source]) -> Source:
    """A merged segment as one record, its rows' times those of ``sources`` (the segments its
    sidecar lists). A merge that replaces it lists it so, with its sidecar's record nested
    (``Merged.within``), and an analysis records it so once its rows are settled
    (analyzers/incremental.py): what a scenario records stays a few records per day and writer,
    not one per flush (a collector's every few seconds: tens of thousands a day)."""
    listed = list(sources)
    oldest = [s.oldest_ns for s in listed if s.oldest_ns is not None]
    newest = [s.newest_ns for s in listed if s.newest_ns is not None]
    return Source(path, size, mtime_ns, min(oldest) if oldest else None, max(newest) if newest else None,
                  merged=True)


def sidecar(segment: Path) -> Path:
    """Where a merged segment's list of the segments it replaced lies (hidden: no glob of
    segments, ``*.parquet``, finds it)."""
    return segment.with_name(f".{segment.name}.sources")


def _read_sidecar(segment: Path) -> Merged | None:
    """The sidecar of ``segment`` when it is one of a merged segment of this size, else None
    (none, another file's, or unreadable: then the segment reads as itself, logged)."""
    path = sidecar(segment)
    try:
        record = json.loads(path.read_text())
        merged = _merged_of(record)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("segment %s: its list of merged segments %s does not read (%s); read as a segment "
                    "of its own", segment, path.name, e)
        return None
    if int(record.get("version", 0)) not in (1, _SIDECAR_VERSION) or merged.size != segment.stat().st_size:
        return None
    return merged


class MergedSegments(Mapping[str, Merged]):
    """The merged segments of a lake with their sidecars, by path under the lake; a sidecar is read
    when its segment is looked up (an analysis looks up only the merged segments it has not
    recorded as themselves: a lake kept 30 days holds the sidecars of every closed day)."""

    def __init__(self, root: Path) -> None:
        self._paths = {}
        for table in LAKE_TABLES:
            for path in sorted((root / table.name).glob("scenario=*/date=*/.*.sources")):
                segment = path.with_name(path.name[1:-len(".sources")])
                self._paths[str(segment.relative_to(root))] = segment
        self._read: dict[str, Merged | None] = {}

    def _get(self, key: str) -> Merged | None:
        if key not in self._read:
            segment = self._paths.get(key)
            self._read[key] = _read_sidecar(segment) if segment is not None and segment.exists() else None
        return self._read[key]

    def __getitem__(self, key: str) -> Merged:
        merged = self._get(key)
        if merged is None:
            raise KeyError(key)
        return merged

    def __iter__(self) -> Iterator[str]:
        return iter([key for key in self._paths if self._get(key) is not None])

    def __len__(self) -> int:
        return sum(1 for _ in self)


def merged_segments(lake: str | os.PathLike[str]) -> MergedSegments:
    """Every merged segment of the lake with its sidecar, by path under the lake (each sidecar read
    when looked up)."""
    return MergedSegments(Path(lake))


def _sources(root: Path, files: Iterable[Path], table: Table, closed: bool) -> Merged:
    """The record of a merge of ``files`` (its size unset): each as recorded, a merged one as
    itself (``unit``) with its sidecar's record nested."""
    out: list[Source] = []
    within: list[Merged | None] = []
    for f in files:
        merged, st, path = _read_sidecar(f), f.stat(), str(f.relative_to(root))
        within.append(merged)
        if merged is not None:
            out.append(unit(path, st.st_size, st.st_mtime_ns, merged.sources))
        else:
            oldest, newest = segment_time_range(f, table.time_column)
            out.append(Source(path, st.st_size, st.st_mtime_ns, oldest, newest))
    return Merged(0, tuple(out), closed, tuple(within) if any(m is not None for m in within) else ())


def _write_merged(root: Path, files: list[Path], table: Table, stage: Path,
                  closed: bool) -> tuple[Path, Path]:
    """``files`` (name order) merged into ``stage`` under the newest one's name, with its metadata,
    and its sidecar beside it (``closed``: a closed day's merge): (segment, sidecar), staged."""
    parts = [read_segment(f, arrow_schema(table)) for f in files]  # (a damaged one: named, moved aside)
    record = _sources(root, files, table, closed)
    last_meta = segment_schema(files[-1]).metadata or {}
    out = stage / files[-1].name
    with open(out, "wb") as f:
        pq.write_table(pa.concat_tables(parts).replace_schema_metadata(last_meta), f, compression="zstd")
        f.flush()
        os.fsync(f.fileno())
    side = sidecar(out)
    with open(side, "w") as text:
        json.dump({"version": _SIDECAR_VERSION,
                   **_merged_record(dataclasses.replace(record, size=out.stat().st_size))}, text)
        text.flush()
        os.fsync(text.fileno())
    return out, side

_KEEP_RE = re.compile(r"^\s*(\d+)\s*d\s*$")


def parse_keep_days(text: str) -> int:
    """Whole days from ``30d``; at least 1 (the current day is never dropped)."""
    m = _KEEP_RE.match(text)
    if not m or int(m.group(1)) < 1:
        raise ConfigError(f"--keep {text!r}: give whole days, at least 1, e.g. --keep 30d")
    return int(m.group(1))


def _check_lake(root: Path) -> None:
    if not root.exists():
        raise ConfigError(f"lake {root} does not exist: pass the directory you import or collect into")
    lake_info(root)


def compact(lake: str | Path, *, today: str | None = None, current: bool = False,
            target_bytes: int = TARGET_BYTES) -> dict[str, int]:
    """Merge each writer's segments of each closed day (before ``today``, UTC) into one per
    partition; with ``current``, also each writer's newest segments of the current day (and any
    later one) while they add up to at most ``target_bytes`` (see the module docstring).

    Per writer, so each writer's newest segment keeps its name and checkpoint (the checkpoint-only
    segments of every collector share the partition of 1970-01-01); one segment at a time, so a
    writer adding a segment beside them, to a closed day too (a request that ended after midnight,
    a checkpoint), loses nothing: the merged segment replaces the newest of its run and removes the
    others in one commit. One compaction at a time per lake (a lock). Returns counts: merged
    segments written, segments they replaced.
    """
    root = Path(lake)
    _check_lake(root)
    today = today or time.strftime("%Y-%m-%d", time.gmtime())
    written = replaced = 0
    with _locked(root):
        for table in LAKE_TABLES:
            for day_dir in sorted((root / table.name).glob("scenario=*/date=*")):
                closed = day_dir.name[len("date="):] < today
                if not closed and not current:
                    continue
                for run in _runs(sorted(day_dir.glob("*.parquet")), None if closed else target_bytes):
                    _merge_run(root, run, table, closed)
                    written += 1
                    replaced += len(run)
    return {"segments_written": written, "segments_replaced": replaced}


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """Hold the lake's compaction lock (``kvlens analyze --compact`` and ``kvlens compact`` may run
    at once: two merges of one run would race)."""
    try:
        f = open(root / ".compact.lock", "a")  # noqa: SIM115 (closed below, after the lock's release)
    except OSError as e:
        raise ConfigError(f"lake {root}: cannot take the compaction lock ({e}); compaction writes "
                          "the lake: run it where the lake is writable") from None
    with f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _runs(files: list[Path], target_bytes: int | None) -> list[list[Path]]:
    """Per writer of a partition (``files`` in name order), the segments to merge into one: all of
    them (``target_bytes`` None: a closed day), or the longest run of its newest segments whose
    sizes add up to at most ``target_bytes``, less its oldest ones while each is larger than the
    newer ones together; when two or more. So a merged segment of the current day is merged again
    once the segments after it have caught up with it (each row is rewritten about log2 of
    ``target_bytes`` over a flush's size times, not once a period), and a writer's day stays a few
    files of sizes doubling back in time."""
    by_writer: dict[str, list[Path]] = defaultdict(list)
    for f in files:
        writer = segment_writer(f.name)
        if writer is not None:  # (a file named otherwise is not a writer's: left as it is)
            by_writer[writer].append(f)
    runs = []
    for segments in by_writer.values():
        if target_bytes is None:
            if len(segments) >= 2:
                runs.append(segments)
            continue
        run: list[tuple[Path, int]] = []
        total = 0
        for f in reversed(segments):
            size = f.stat().st_size
            if total + size > target_bytes:
                break
            run.insert(0, (f, size))
            total += size
        while len(run) >= 2 and run[0][1] > total - run[0][1]:
            total -= run.pop(0)[1]
        if len(run) >= 2:
            runs.append([f for f, _ in run])
    return runs


def _merge_run(root: Path, run: list[Path], table: Table, closed: bool) -> None:
    """One writer's run of segments merged into its newest, in one commit: the merged segment and
    its sidecar replace the newest; the others, and their sidecars, go."""
    stage = root / STAGING / staging_token()
    stage.mkdir(parents=True)
    try:
        out, side = _write_merged(root, run, table, stage, closed)
        newest = run[-1]
        pairs: list[tuple[Path | None, Path]] = [(out, newest), (side, sidecar(newest))]
        for f in run[:-1]:
            pairs.append((None, f))
            if sidecar(f).exists():
                pairs.append((None, sidecar(f)))
        swap_in(root, pairs)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _empty(path: Path) -> bool:
    return bool(pq.read_metadata(path).num_rows == 0)


def drop_old_days(lake: str | Path, keep_days: int, *, scenarios: tuple[str, ...] = (),
                  today: str | None = None) -> dict[str, int]:
    """Drop the raw partitions dated before ``today - keep_days`` (UTC), a whole day at a time: every
    row dropped is older than ``keep_days`` days, and the current day is never touched.

    Every table's segments of one day (of ``scenarios``, default all) go in one commit
    (kvlens/commit.py's journal: a reader or a crash sees the day whole or gone, never one
    table without the other). The commit removes the segments listed, one by one, not the
    partitions: a segment a writer adds to an old partition meanwhile stays (a request that ended
    after midnight; a checkpoint: every collector's checkpoint-only segments are dated 1970-01-01,
    a partition every retention reaches). Segments that hold no rows stay: they carry writers'
    checkpoints, and a collector that restarts resumes from them. Under the compaction lock, so a
    merge never writes back a day being dropped. The analysis DB is a separate file and is not
    touched. Returns counts.
    """
    root = Path(lake)
    _check_lake(root)
    if keep_days < 1:
        raise ConfigError(f"keep {keep_days} days: keep at least 1 (the current day is never dropped)")
    today = today or time.strftime("%Y-%m-%d", time.gmtime())
    # a day D is dropped when it ended at least keep_days before today began: its every row is older
    cutoff = (dt.date.fromisoformat(today) - dt.timedelta(days=keep_days)).isoformat()
    dropped_days = partitions = segments = 0
    with _locked(root):
        days: dict[str, list[Path]] = defaultdict(list)
        for table in LAKE_TABLES:
            for day_dir in sorted((root / table.name).glob("scenario=*/date=*")):
                scenario = day_dir.parent.name[len("scenario="):]
                if day_dir.name[len("date="):] < cutoff and (not scenarios or scenario in scenarios):
                    days[day_dir.name].append(day_dir)
        for day in sorted(days):
            pairs: list[tuple[Path | None, Path]] = []
            touched = 0
            for day_dir in days[day]:
                drop = [f for f in sorted(day_dir.glob("*.parquet")) if not _empty(f)]
                touched += bool(drop)
                for f in drop:
                    pairs.append((None, f))
                    if sidecar(f).exists():  # a merged segment's record of what it replaced
                        pairs.append((None, sidecar(f)))
                segments += len(drop)
            if pairs:
                swap_in(root, pairs)
                for day_dir in days[day]:
                    _remove_if_empty(day_dir)
                dropped_days += 1
                partitions += touched
    return {"days_dropped": dropped_days, "partitions_dropped": partitions, "segments_dropped": segments}


def _remove_if_empty(day_dir: Path) -> None:
    with contextlib.suppress(OSError):  # it still holds checkpoint segments
        day_dir.rmdir()
