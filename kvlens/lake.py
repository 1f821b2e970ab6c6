"""The spine's storage: immutable Parquet segments in a hive-partitioned lake, and DuckDB views.

Layout: ``LAKE/<table>/scenario=NAME/date=YYYY-MM-DD/<writer>-<n>.parquet``.

- A segment is written under a hidden temporary name, fsynced, then renamed, so a reader
  (any glob on ``*.parquet``) never sees half a segment.
- A writer opened with ``replace=True`` writes into ``LAKE/.staging/``; ``commit()`` (or
  ``commit_together`` for the tables of one import) swaps the scenario's directories in
  whole under an undo journal (kvlens/commit.py): a re-import replaces, never duplicates, and
  a process killed at any point leaves every table's previous rows.
- Each segment carries its writer's checkpoint (a JSON dict) in the Parquet key-value
  metadata; ``latest_checkpoint`` returns the newest one, so a restarted collector resumes.
- A replace that wrote no rows at all (an empty input file) is refused with EmptyReplaceError and
  the scenario keeps its rows, unless the caller runs it inside ``empty_replace_allowed()``.
- Memory is bounded by ``flush_rows``: reaching it flushes synchronously, which is the
  back-pressure a fast producer feels when the disk is slow.
- A flush the disk refuses (an OSError) raises with the unwritten rows still buffered, so
  that the caller can retry it: a write failure never drops accepted rows by itself.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvlens.commit import STAGING, fsync_path, recover, staging_token, swap_in, tmp_name, wait_for_commits
from kvlens.damage import damaged_segment_error, segment_schema
from kvlens.errors import ConfigError, EmptyReplaceError
from kvlens.marker import lake_info
from kvlens.schema import ENUMS, LAKE_TABLES, SCHEMA_VERSION, TABLES, Table, arrow_schema

__all__ = [
    "SegmentWriter",
    "commit_together",
    "create_enum_types",
    "empty_replace_allowed",
    "lake_info",
    "latest_checkpoint",
    "open_lake",
    "positioned_sql",
    "segment_files",
    "segment_time_range",
    "segment_writer",
    "write_scenario",
    "writer_checkpoints",
]

log = logging.getLogger(__name__)

_NS_PER_DAY = 86_400 * 1_000_000_000
_CHECKPOINT_KEY = b"kvlens.checkpoint"
_VERSION_KEY = b"kvlens.schema_version"
_WRITER_KEY = b"kvlens.writer"
_SEGMENT_RE = re.compile(r"^(?P<writer>.+)-(?P<n>\d{20})\.parquet$")
_SCENARIO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
_ALLOW_EMPTY: ContextVar[bool] = ContextVar("kvlens_allow_empty_replace", default=False)


@contextmanager
def empty_replace_allowed() -> Iterator[None]:
    """Within it, a replace that read no rows empties its scenario instead of being refused."""
    token = _ALLOW_EMPTY.set(True)
    try:
        yield
    finally:
        _ALLOW_EMPTY.reset(token)


def _check_scenario(scenario: str) -> str:
    if not _SCENARIO_RE.match(scenario):
        raise ConfigError(
            f"scenario name {scenario!r} is not usable as a directory name: "
            "use letters, digits, '_', '-' and '.', starting with a letter or digit"
        )
    return scenario


class SegmentWriter:
    """Buffers rows for one lake table and writes each flush as immutable segments.

    Rows arrive as dicts (``append_rows``), columns (``append_columns``) or Arrow data
    (``append_arrow``); columns the source lacks are NULL. Use as a context manager: an
    exception aborts (staged segments are removed), a clean exit flushes and commits.
    """

    def __init__(
        self,
        lake: str | os.PathLike[str],
        table: str | Table,
        *,
        scenario: str = "default",
        writer_id: str = "kvlens",
        replace: bool = False,
        flush_rows: int = 1_000_000,
        flush_age_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.table = TABLES[table] if isinstance(table, str) else table
        if self.table.kind != "lake":
            raise ConfigError(f"{self.table.name} is an analysis table, not a lake table")
        if "/" in writer_id or not writer_id:
            raise ConfigError(f"writer id {writer_id!r} must be a non-empty name without '/'")
        self.lake = Path(lake)
        lake_info(self.lake, create=True)
        recover(self.lake)
        self.scenario = _check_scenario(scenario)
        self.writer_id = writer_id
        self.replace = replace
        self.flush_rows = flush_rows
        self.flush_age_s = flush_age_s
        self.clock = clock
        self.schema = arrow_schema(self.table)
        self.rows_written = 0
        self.segments_written = 0
        self.bytes_written = 0  # of the segments committed, on disk
        self._chunks: list[pa.Table] = []
        self._buffered = 0
        self._oldest: float | None = None
        self._last_n = 0
        self._closed = False
        final_dir = self.lake / self.table.name / f"scenario={self.scenario}"
        if replace:
            self._stage_root = self.lake / STAGING / staging_token()
            self._target = self._stage_root / self.table.name / f"scenario={self.scenario}"
        else:
            self._target = final_dir
        self._final = final_dir

    # -- appending -----------------------------------------------------------------------

    @property
    def buffered_rows(self) -> int:
        return self._buffered

    def take_buffer(self) -> pa.Table:
        """The buffered rows, removed from the writer (to spill them elsewhere when the lake refuses)."""
        data = pa.concat_tables(self._chunks) if self._chunks else self.schema.empty_table()
        self._chunks, self._buffered, self._oldest = [], 0, None
        return data

    def append_rows(self, rows: Iterable[Mapping[str, Any]]) -> None:
        self._add(pa.Table.from_pylist(list(rows), schema=self.schema))

    def append_columns(self, columns: Mapping[str, Any]) -> None:
        """Append equal-length columns (lists or NumPy arrays) keyed by column name."""
        lengths = {len(v) for v in columns.values()}
        if len(lengths) != 1:
            raise ValueError(f"columns for {self.table.name} differ in length: {sorted(lengths)}")
        n = lengths.pop()
        arrays = [
            pa.array(columns[f.name], type=f.type) if f.name in columns else pa.nulls(n, f.type)
            for f in self.schema
        ]
        unknown = set(columns) - set(self.schema.names) - {"scenario"}
        if unknown:
            raise ValueError(f"{self.table.name} has no column(s) {sorted(unknown)}")
        self._add(pa.Table.from_arrays(arrays, schema=self.schema))

    def append_arrow(self, data: pa.Table | pa.RecordBatch) -> None:
        t = pa.Table.from_batches([data]) if isinstance(data, pa.RecordBatch) else data
        n = t.num_rows
        arrays = [
            t.column(f.name).cast(f.type) if f.name in t.column_names else pa.nulls(n, f.type)
            for f in self.schema
        ]
        self._add(pa.Table.from_arrays(arrays, schema=self.schema))

    def _add(self, t: pa.Table) -> None:
        if self._closed:
            raise RuntimeError("append to a closed SegmentWriter")
        if t.num_rows == 0:
            return
        self._chunks.append(t)
        self._buffered += t.num_rows
        if self._oldest is None:
            self._oldest = self.clock()
        if self._buffered >= self.flush_rows:
            self.flush()
        else:
            self.maybe_flush()

    def maybe_flush(self, checkpoint: Mapping[str, Any] | None = None) -> bool:
        """Flush when the oldest buffered row is older than ``flush_age_s``."""
        if (self.flush_age_s is not None and self._oldest is not None
                and self.clock() - self._oldest >= self.flush_age_s):
            self.flush(checkpoint)
            return True
        return False

    # -- writing -------------------------------------------------------------------------

    def flush(self, checkpoint: Mapping[str, Any] | None = None) -> int:
        """Write the buffer as one segment per date; returns the rows written.

        With an empty buffer and a checkpoint, an empty segment records the checkpoint.
        """
        if not self._chunks and checkpoint is None:
            return 0
        data = pa.concat_tables(self._chunks) if self._chunks else self.schema.empty_table()
        self._chunks, self._buffered, self._oldest = [], 0, None
        meta = {
            _VERSION_KEY: str(SCHEMA_VERSION).encode(),
            _WRITER_KEY: self.writer_id.encode(),
            _CHECKPOINT_KEY: json.dumps(dict(checkpoint or {})).encode(),
        }
        data = data.replace_schema_metadata(meta)
        parts = self._split_by_date(data)
        for i, (date, part) in enumerate(parts):
            try:
                self._write_segment(date, part)
            except BaseException:
                # The disk refused (full, gone): keep what was not written, so that a retry
                # writes it and no accepted row is dropped; the parts before are committed.
                rest = [p.replace_schema_metadata(None) for _, p in parts[i:]]
                self._chunks = rest + self._chunks
                self._buffered += sum(p.num_rows for p in rest)
                self._oldest = self._oldest if self._oldest is not None else self.clock()
                self.rows_written += sum(p.num_rows for _, p in parts[:i])
                raise
        self.rows_written += data.num_rows
        return data.num_rows

    def _split_by_date(self, data: pa.Table) -> list[tuple[str, pa.Table]]:
        tcol = self.table.time_column
        if tcol is None or data.num_rows == 0:
            return [("1970-01-01", data)]
        days = pc.fill_null(pc.divide(data.column(tcol), _NS_PER_DAY), 0)
        unique = pc.unique(days).to_pylist()
        if len(unique) == 1:
            return [(_day_str(unique[0]), data)]
        return [(_day_str(d), data.filter(pc.equal(days, d))) for d in sorted(unique)]

    def _next_name(self) -> str:
        # Names sort in write order across restarts: the number is a wall-clock nanosecond
        # stamp, forced to grow within the process.
        n = max(time.time_ns(), self._last_n + 1)
        self._last_n = n
        return f"{self.writer_id}-{n:020d}.parquet"

    def _write_segment(self, date: str, part: pa.Table) -> None:
        directory = self._target / f"date={date}"
        directory.mkdir(parents=True, exist_ok=True)
        name = self._next_name()
        tmp = directory / tmp_name(name)
        try:
            with open(tmp, "wb") as f:
                pq.write_table(part, f, compression="snappy")
                f.flush()
                os.fsync(f.fileno())
                size = f.tell()
            os.replace(tmp, directory / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_path(directory)
        self.segments_written += 1
        self.bytes_written += size

    # -- finishing -----------------------------------------------------------------------

    def commit(self, checkpoint: Mapping[str, Any] | None = None) -> None:
        """Flush; with ``replace``, swap the staged scenario in place of the old one."""
        if self.replace:
            commit_together(self, checkpoint=checkpoint)
        else:
            self.flush(checkpoint)
            self._closed = True

    def stage(self, checkpoint: Mapping[str, Any] | None = None) -> tuple[Path, Path]:
        """Flush and close a ``replace`` writer; its (staged, final) scenario directories."""
        if not self.replace:
            raise RuntimeError("only a replace=True writer stages")
        self.flush(checkpoint)
        self._closed = True
        self._target.mkdir(parents=True, exist_ok=True)
        return self._target, self._final

    def abort(self) -> None:
        """Drop the buffer; with ``replace``, remove everything staged."""
        self._chunks, self._buffered, self._closed = [], 0, True
        if self.replace:
            shutil.rmtree(self._stage_root, ignore_errors=True)

    def __enter__(self) -> SegmentWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._closed:
            return
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def _day_str(day: int) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(int(day) * 86_400))


def commit_together(*writers: SegmentWriter, checkpoint: Mapping[str, Any] | None = None) -> None:
    """Swap the staged scenarios of ``replace`` writers (one lake) in, all tables or none."""
    lake = writers[0].lake
    staged = [w.stage(checkpoint) for w in writers]
    if not any(w.rows_written for w in writers) and not _ALLOW_EMPTY.get():
        for w in writers:
            shutil.rmtree(w._stage_root, ignore_errors=True)
        raise EmptyReplaceError(
            f"no rows were read for scenario {writers[0].scenario!r}, so lake {lake} keeps its previous "
            "rows: check the input, or allow an empty replacement (kvlens import --allow-empty)")
    swap_in(lake, staged)
    for w in writers:
        shutil.rmtree(w._stage_root, ignore_errors=True)


def write_scenario(lake: str | os.PathLike[str], scenario: str, tables: Mapping[str, pa.Table],
                   *, writer_id: str) -> dict[str, int]:
    """Write whole tables of one scenario, replacing that scenario's rows in all of them at once."""
    writers = [SegmentWriter(lake, name, scenario=scenario, writer_id=writer_id, replace=True)
               for name in tables]
    try:
        for w, data in zip(writers, tables.values(), strict=True):
            w.append_arrow(data)
        commit_together(*writers)
    except BaseException:
        for w in writers:
            w.abort()
        raise
    return {name: data.num_rows for name, data in tables.items()}


def segment_files(lake: str | Path, table: str, scenario: str | None = None) -> list[Path]:
    """Committed segments of one table (optionally one scenario), in name order."""
    base = Path(lake) / table
    pattern = f"scenario={scenario}/date=*/*.parquet" if scenario else "scenario=*/date=*/*.parquet"
    return sorted(base.glob(pattern))


def segment_writer(name: str) -> str | None:
    """The writer id in a segment's file name (``<writer>-<20 digits>.parquet``), or None."""
    m = _SEGMENT_RE.match(name)
    return m.group("writer") if m else None


def segment_time_range(path: Path, column: str | None) -> tuple[int | None, int | None]:
    """(oldest, newest) of ``column`` in one segment, from its row-group statistics (no data read);
    (None, None) when the column is absent or a row group has no statistics."""
    if column is None:
        return None, None
    meta = pq.read_metadata(path)
    names = [meta.schema.column(i).name for i in range(meta.num_columns)]
    if column not in names:
        return None, None
    idx = names.index(column)
    lows, highs = [], []
    for g in range(meta.num_row_groups):
        stats = meta.row_group(g).column(idx).statistics
        if stats is None or not stats.has_min_max:
            return None, None
        lows.append(int(stats.min))
        highs.append(int(stats.max))
    return (min(lows), max(highs)) if lows else (None, None)


def latest_checkpoint(lake: str | Path, writer: str) -> dict[str, Any] | None:
    """The checkpoint of ``writer``'s newest segment in any table, or None."""
    newest: tuple[int, Path] | None = None
    for path in Path(lake).glob(f"*/scenario=*/date=*/{writer}-*.parquet"):
        m = _SEGMENT_RE.match(path.name)
        if m and m.group("writer") == writer:
            n = int(m.group("n"))
            if newest is None or n > newest[0]:
                newest = (n, path)
    if newest is None:
        return None
    meta = segment_schema(newest[1]).metadata or {}
    raw = meta.get(_CHECKPOINT_KEY)
    return json.loads(raw) if raw else {}


def writer_checkpoints(lake: str | Path, table: str, scenario: str) -> dict[str, dict[str, Any]]:
    """The checkpoint of every writer's newest segment of ``table`` in ``scenario``, by writer id
    (a collector resuming what other writers of the same sources left: a fleet that changed)."""
    newest: dict[str, tuple[int, Path]] = {}
    for path in Path(lake).glob(f"{table}/scenario={glob.escape(scenario)}/date=*/*.parquet"):
        m = _SEGMENT_RE.match(path.name)
        if m and (m.group("writer") not in newest or int(m.group("n")) > newest[m.group("writer")][0]):
            newest[m.group("writer")] = (int(m.group("n")), path)
    out = {}
    for writer, (_, path) in sorted(newest.items()):
        raw = (segment_schema(path).metadata or {}).get(_CHECKPOINT_KEY)
        out[writer] = json.loads(raw) if raw else {}
    return out


def _literal(text: str) -> str:
    # View definitions cannot take bound parameters; a path is quoted as a SQL literal.
    return "'" + text.replace("'", "''") + "'"


def create_enum_types(con: duckdb.DuckDBPyConnection) -> None:
    """Create the schema's ENUM types on ``con`` where they do not exist yet."""
    have = {
        r[0] for r in con.execute(
            "SELECT type_name FROM duckdb_types() WHERE database_name = current_database()"
        ).fetchall()
    }
    for name, enum_cls in ENUMS.items():
        if name not in have:
            values = ", ".join(_literal(m.value) for m in enum_cls)
            con.execute(f"CREATE TYPE {name} AS ENUM ({values})")


def _uniform_schema(files: list[Path]) -> pa.Schema | None:
    """The one schema (column names and types, in order) every file of ``files`` has; None when
    they differ or a footer does not read (the view then matches columns by name, and DuckDB
    names a damaged file)."""
    first = None
    for path in files:
        try:
            schema = pq.read_schema(path).remove_metadata()
        except (OSError, pa.ArrowException):
            return None
        if first is None:
            first = schema
        elif not schema.equals(first):
            return None
    return first


def _view_sql(con: duckdb.DuckDBPyConnection, lake: Path, table: Table, *, positions: bool = False) -> str:
    files = segment_files(lake, table.name)
    where = ", CAST(NULL AS VARCHAR) AS _segment, CAST(NULL AS BIGINT) AS _row" if positions else ""
    if not files:
        cols = ", ".join(f"CAST(NULL AS {c.type}) AS {c.name}" for c in table.columns)
        return f"SELECT {cols}{where} WHERE false"
    glob = str((lake / table.name).resolve()) + "/scenario=*/date=*/*.parquet"
    # Segments written before a column was added lack it: DuckDB then matches columns by name
    # across files (union_by_name), which reads every file's footer at each query's bind. When
    # all segments share one schema (the usual lake), one footer is enough: measured here, a
    # bind over 6 segments costs half as much, and an analysis binds some 150 queries.
    uniform = _uniform_schema(files)
    source = (f"read_parquet({_literal(glob)}, hive_partitioning = true, "
              f"union_by_name = {'false' if uniform is not None else 'true'}, hive_types_autocast = false"
              f"{', filename = true, file_row_number = true' if positions else ''})")
    # A column added to the schema after a lake's segments were written is NULL there.
    try:
        present = {row[0] for row in con.execute(f"DESCRIBE SELECT * FROM {source}").fetchall()}
    except duckdb.Error as e:
        raise damaged_segment_error(files, e) from None
    cols = ", ".join(
        "CAST(scenario AS VARCHAR) AS scenario" if c.name == "scenario"
        else f"CAST({c.name} AS {c.type}) AS {c.name}" if c.name in present
        else f"CAST(NULL AS {c.type}) AS {c.name}"
        for c in table.columns
    )
    where = ", filename AS _segment, file_row_number AS _row" if positions else ""
    return f"SELECT {cols}{where} FROM {source}"


def positioned_sql(con: duckdb.DuckDBPyConnection, lake: str | os.PathLike[str], table: str) -> str:
    """The SELECT of ``table``'s lake view (``open_lake``) with two more columns: ``_segment``,
    the path of the segment a row is read from, and ``_row``, its row number there. A scan of the
    view reads the segments in path order (DuckDB sorts a glob's files) and each in row order, so
    ordering by (``_segment``, ``_row``) is the order a scan of the view returns: what a sort that
    must break ties as a stable sort of that scan does orders by last (analyzers/out_of_core.py)."""
    return _view_sql(con, Path(lake), TABLES[table], positions=True)


def open_lake(con: duckdb.DuckDBPyConnection, lake: str | os.PathLike[str], *,
              temp: bool = False) -> list[str]:
    """Register one view per lake table on ``con``; empty tables get empty, typed views.

    Views bind the files present now: reopen after new segments to see them.
    """
    root = Path(lake)
    if not root.exists():
        raise ConfigError(f"lake {root} does not exist: import or collect into it first")
    lake_info(root)
    try:
        recover(root)
    except OSError as e:  # a read-only mount: read what is there
        log.warning("lake %s: could not recover unfinished commits: %s", root, e)
    if not wait_for_commits(root):
        log.warning("lake %s: a commit is still in progress; views may mix old and new rows", root)
    create_enum_types(con)
    kind = "TEMP VIEW" if temp else "VIEW"
    for table in LAKE_TABLES:
        con.execute(f"CREATE OR REPLACE {kind} {table.name} AS {_view_sql(con, root, table)}")
    return [t.name for t in LAKE_TABLES]
