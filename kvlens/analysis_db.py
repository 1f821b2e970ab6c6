"""The spine's analysis DB writer: result frames -> a new DuckDB file, renamed into place.

The file holds the analysis tables (typed as kvlens/schema.py declares them), the schema's
ENUM types, and views over the lake by absolute path, so ``duckdb kvlens.duckdb`` answers
SQL over raw and derived data alike. Readers never see a half-built file: it is written
under a temporary name and renamed over the old one; a build that was killed leaves that
name behind, and the next build removes it (the name carries the builder's process id).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import duckdb
import polars as pl

from kvlens import memory
from kvlens.commit import fsync_path, remove_dead_tmp, tmp_name
from kvlens.errors import ConfigError, InputError
from kvlens.lake import create_enum_types, open_lake
from kvlens.schema import ANALYSIS_TABLES, SCHEMA_VERSION, TABLES

__all__ = ["attach_analysis_db", "build_analysis_db", "check_duckdb_file", "remove_dead_leftovers",
           "settings"]

# A DuckDB file starts with an 8-byte checksum and the magic "DUCK" (storage format docs:
# https://duckdb.org/docs/stable/internals/storage).
_MAGIC, _MAGIC_AT = b"DUCK", 8

Compute = Callable[[duckdb.DuckDBPyConnection], Iterable[tuple[str, pl.DataFrame]]]

# Rows per row group of the tables the DB is built with (DuckDB's default: 122,880). An
# incremental analysis appends to a copy of the previous DB, and a checkpoint rewrites each row
# group its appends and deletes touched: with the default, that is the whole of a table of up to
# 122,880 rows however few were appended. Measured on bench_incremental's 6th increment (a
# quarter of block_outcomes' rows deleted and written again): inserts, commit and checkpoint
# took 108 ms with the default and 52 ms with this size.
ROW_GROUP_ROWS = 16_384
_ALIAS = "analysis"  # the name the DB being built is attached under
# Any commit of a build checkpoints at once rather than write the write-ahead log (``_connect``).
CHECKPOINT_THRESHOLD = "1KB"


def _create_tables(con: duckdb.DuckDBPyConnection) -> None:
    for table in ANALYSIS_TABLES:
        cols = ", ".join(f"{c.name} {c.type}" for c in table.columns)
        con.execute(f"CREATE TABLE {table.name} ({cols})")
    con.execute("CREATE TABLE kvlens_meta (key VARCHAR, value VARCHAR)")
    con.execute("INSERT INTO kvlens_meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])


def _insert(con: duckdb.DuckDBPyConnection, name: str, frame: pl.DataFrame) -> None:
    table = TABLES[name]
    missing = [c for c in table.names if c not in frame.columns]
    if missing:
        raise ValueError(f"frame for {name} lacks columns {missing}")
    con.register("_frame", frame.select(table.names))
    cols = ", ".join(f"CAST({c.name} AS {c.type})" for c in table.columns)
    con.execute(f"INSERT INTO {name} SELECT {cols} FROM _frame")
    con.unregister("_frame")


def check_duckdb_file(path: str | os.PathLike[str]) -> Path:
    """``path`` if it is an existing DuckDB file; else a one-line ConfigError saying what it is."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"analysis DB {p} does not exist: run kvlens analyze --lake LAKE --db {p} first")
    if not p.is_file():
        raise ConfigError(f"analysis DB {p} is not a file: pass the file kvlens analyze wrote")
    try:
        with open(p, "rb") as f:
            head = f.read(_MAGIC_AT + len(_MAGIC))
    except OSError as e:
        raise ConfigError(f"analysis DB {p} cannot be read ({e.strerror}): check its permissions") from None
    if head[_MAGIC_AT:] != _MAGIC:
        raise ConfigError(f"{p} is not a DuckDB file: pass the analysis DB kvlens analyze wrote")
    return p


def attach_analysis_db(con: duckdb.DuckDBPyConnection, db: str | os.PathLike[str], alias: str) -> None:
    """Attach the analysis DB ``db`` to ``con`` read-only as ``alias`` (one-line errors)."""
    path = check_duckdb_file(db).resolve()
    try:
        con.execute(f"ATTACH {_quoted(str(path))} AS {alias} (READ_ONLY)")
    except duckdb.Error as e:
        raise ConfigError(f"cannot open analysis DB {path}: {str(e).splitlines()[0]}: "
                          "pass a file written by kvlens analyze (rerun it if this one is damaged)") from None


def _quoted(text: str) -> str:
    # ATTACH takes no bound parameters; the path is quoted as a SQL literal.
    return "'" + text.replace("'", "''") + "'"


@contextlib.contextmanager
def settings(con: duckdb.DuckDBPyConnection, **values: bool | int | str) -> Iterator[dict[str, object]]:
    """DuckDB settings on ``con`` for the ``with`` block (``settings(con, threads=1)``), each put
    back after it to what it was, also when the block raises or a generator holding it is closed.
    Yields the values they had (by name), read in one statement before any is changed. A size
    DuckDB shows cut to one decimal (``memory_limit``: 1.8 GiB shows as "1.7 GiB"; DuckDB gives no
    exact value to read) is put back as the fewest bytes DuckDB shows so (``_shown_bytes``): up to
    a tenth of its unit lower once, and then unchanged however many blocks set it and put it back
    (put back as the text it showed, "1.7 GiB" parses a little under 1.7 GiB and shows as "1.6
    GiB": each block lowered it by another tenth)."""
    names = list(values)
    read = "SELECT " + ", ".join(f"current_setting({_quoted(n)})" for n in names)
    (before,) = con.execute(read).fetchall() if names else [()]
    previous = dict(zip(names, before, strict=True))
    changed: list[str] = []
    try:
        for name, value in values.items():
            con.execute(f"SET {name} = {_setting(value)}")
            changed.append(name)
        yield previous
    finally:
        for name in reversed(changed):
            shown = previous[name]
            exact = _shown_bytes(shown) if isinstance(shown, str) else None
            con.execute(f"SET {name} = {_setting(shown if exact is None else f'{exact}B')}")


# How DuckDB shows a size (StringUtil::BytesToHumanReadableString, src/common/string_util.cpp): the
# largest unit with a whole count, then the next unit's remainder times 10 divided by 1024, cut:
# "1.7 GiB" is 1 GiB and 717 to 819 MiB (716 MiB shows as "1.6 GiB").
_BINARY_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")
_SHOWN_SIZE = re.compile(rf"(\d+)\.(\d) ({'|'.join(_BINARY_UNITS)})")


def _shown_bytes(text: str) -> int | None:
    """The fewest bytes DuckDB shows as ``text`` ("1.7 GiB"), or None when it is not such a size."""
    got = _SHOWN_SIZE.fullmatch(text)
    if got is None:
        return None
    whole, tenth, unit = int(got[1]), int(got[2]), got[3]
    power = _BINARY_UNITS.index(unit) + 1
    return whole * 1024**power + -(-tenth * 1024 // 10) * 1024**(power - 1)


def _setting(value: object) -> str:
    """A setting's value as SQL: true/false, an integer, else a quoted string."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return _quoted(str(value))


def _lake_read_error(e: duckdb.Error, lake: str | os.PathLike[str]) -> Exception:
    """A DuckDB error that names a file of the lake is a damaged segment; anything else is a bug."""
    first = str(e).splitlines()[0]
    if str(Path(lake).resolve()) in first:
        return InputError(f"{first}: a lake segment is damaged; move the file it names out of the lake "
                          "and rerun (the other segments are intact)")
    return e


def _target(db: str | os.PathLike[str]) -> Path:
    """Where the DB goes: a new path, or an existing DuckDB file to replace (never anything else)."""
    final = Path(db).resolve()
    if final.is_dir():
        raise ConfigError(f"--db {db} is a directory: name the analysis DB file, "
                          f"e.g. {Path(db) / 'kvlens.duckdb'}")
    if final.exists():
        check_duckdb_file(final)  # replace an analysis DB, never some other file
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the directory of --db {db} ({e.strerror}): "
                          "choose a path whose parent is (or can be made) a directory") from None
    return final


def remove_dead_leftovers(db: str | os.PathLike[str]) -> int:
    """Remove what builds of ``db`` by processes now dead left beside it (the half-written DB,
    its WAL and DuckDB's spill directory); returns how many were removed."""
    final = Path(db).resolve()
    return remove_dead_tmp(final.parent.glob(f".{glob.escape(final.name)}.*.tmp*"))


def _connect(path: Path, memory_limit: int | None = None) -> duckdb.DuckDBPyConnection:
    """A connection whose current database is the file ``path``, attached with ``ROW_GROUP_ROWS``
    rows per row group (a setting of the attach, not of the file: every build attaches so) and
    spilling where a connection to the file itself would (``<path>.tmp``).

    DuckDB does not sync its writes here (``fsync_mode`` NONE): the file is a temporary one, which
    no reader opens and a killed build leaves to be removed, so its commits need no durability of
    their own; ``build_analysis_db`` syncs the finished file once before renaming it into place,
    and the directory after. Measured on the 6th of 6 increments of a steady 8-replica fleet
    (tests/bench/bench_incremental.py; a copy of the previous DB, appended to): commit, checkpoint
    and sync took 66 ms with DuckDB's syncs and 54 ms so (the 1st increment, a new file: 30 and 26).

    For the same reason no commit goes through the write-ahead log: with ``checkpoint_threshold``
    below any transaction's size, DuckDB checkpoints at the commit instead of appending to the
    WAL, so rows are written once, not to the WAL and again at the ``CHECKPOINT``; a commit that
    cannot checkpoint (another cursor's transaction open) still goes to the WAL, and the final
    ``CHECKPOINT`` moves it. Measured on the whole sample trace's 6th of 6 increments: its commit
    wrote a 10.1 MB WAL (the state blobs, 6.2 MB, among it) and its CHECKPOINT then took about 40
    ms; without the WAL, in 6 alternated child processes each (fastest), the 1st increment took
    1,254 ms instead of 1,314 and the 6th 1,975 ms instead of 2,036: a fixed saving, not a change
    of the 6th's ratio to the 1st."""
    config: dict[str, str | bool | int | float | list[str]] = {
        "temp_directory": str(path) + ".tmp", "fsync_mode": "NONE",
        "checkpoint_threshold": CHECKPOINT_THRESHOLD}
    if memory_limit is not None:  # DuckDB's share of the analysis' limit (kvlens/memory.py): it spills past
        config["memory_limit"] = f"{max(1, memory_limit // 2)}B"
    con = duckdb.connect(config=config)
    try:
        con.execute(f"ATTACH {_quoted(str(path))} AS {_ALIAS} (ROW_GROUP_SIZE {ROW_GROUP_ROWS})")
        con.execute(f"USE {_ALIAS}")
    except BaseException:
        con.close()
        raise
    return con


def _sync_meanwhile(path: Path) -> threading.Thread:
    """A thread that syncs ``path`` (a copy of the previous DB, just written) while the analysis
    runs: the final sync then writes only the pages the analysis changed. The copy's pages are
    most of the file, and the file grows with the lake's age: on the 6th of 6 increments of the
    whole sample trace (30 MB) the final sync took 44 ms, against 13 ms for the 1st (a new file).
    A failure here is not reported: the final sync, which must succeed, meets it again."""
    def sync() -> None:
        with contextlib.suppress(OSError):
            fsync_path(path)

    thread = threading.Thread(target=sync, name=f"sync {path.name}", daemon=True)
    thread.start()
    return thread


def build_analysis_db(db: str | os.PathLike[str], lake: str | os.PathLike[str], compute: Compute, *,
                      base: str | os.PathLike[str] | None = None,
                      accept: Callable[[duckdb.DuckDBPyConnection], bool] | None = None,
                      memory_limit: int | None = None) -> Path:
    """Build the analysis DB at ``db`` from ``lake``; ``compute`` yields (table, frame) pairs.

    It is written under a hidden name that carries this process's id, beside the target, and
    renamed over it; leftovers of killed builds are removed first (``remove_dead_leftovers``).
    ``base``: an analysis DB of this schema version to start from, copied (``compute`` then
    deletes what it replaces): unchanged rows are not written again. ``accept``: asked, with the
    copy open, whether it can be the start (one connection instead of a second to check the base
    first); when it says no, the DB is built in a new file. ``memory_limit``: the analysis' limit in
    bytes (``kvlens analyze --memory-limit``); DuckDB gets half of it, and spills past that.
    """
    final = _target(db)
    remove_dead_leftovers(final)
    tmp = final.with_name(tmp_name(final.name))
    early: threading.Thread | None = None
    try:
        if base is not None:
            shutil.copyfile(base, tmp)
            early = _sync_meanwhile(tmp)
        con = _connect(tmp, memory_limit)
        if base is not None and accept is not None and not accept(con):
            con.close()
            for copied in (tmp, tmp.with_name(tmp.name + ".wal")):
                copied.unlink(missing_ok=True)
            base = None
            con = _connect(tmp, memory_limit)
        try:
            # The ledger reads its previous rows back in the order they were written (the default).
            con.execute("SET preserve_insertion_order = true")
            create_enum_types(con)
            open_lake(con, lake)
            if base is None:
                _create_tables(con)
            pairs = compute(con)
            try:
                for name, frame in pairs:
                    _insert(con, name, frame)
                    memory.check()  # past the analysis' memory limit it stops here, between tables
            except duckdb.Error as e:
                raise _lake_read_error(e, lake) from None
            finally:
                close = getattr(pairs, "close", None)  # a generator's own cleanup, before the DB closes
                if close is not None:
                    close()
            memory.check()
            con.execute("CHECKPOINT")
        finally:
            con.close()
        # Write, sync, rename, sync the directory: a reader of ``final`` sees the old file or the
        # whole new one, also after a crash of the machine (DuckDB did not sync, see _connect).
        if early is not None:
            early.join()
        fsync_path(tmp)
        os.replace(tmp, final)
        fsync_path(final.parent)
    finally:
        if early is not None:
            early.join()  # (its descriptor closed before the file goes)
        for leftover in (tmp, tmp.with_name(tmp.name + ".wal")):
            leftover.unlink(missing_ok=True)
        shutil.rmtree(tmp.with_name(tmp.name + ".tmp"), ignore_errors=True)  # DuckDB's spill directory
    return final
