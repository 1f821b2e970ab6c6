"""The spine's scenario commit: staged directories swapped into the lake under an undo journal.

Replacing a scenario touches one directory per table (``<table>/scenario=NAME``), and a
rename moves only one. So ``swap_in`` writes a journal first (who is committing, and per
directory: the staged path, the final path, where the old one goes), then renames each old
directory to trash and each staged one into place, and commits by deleting the journal.

- An error (or KeyboardInterrupt) half-way undoes the renames before it propagates.
- A process killed half-way leaves its journal. ``recover`` (run by every writer and by
  ``open_lake``) sees that the owner is dead and undoes the renames, so readers find the
  previous rows of every table, never new blocks beside old requests.
- The window between two renames of a live commit is milliseconds; ``open_lake`` waits for
  live journals to go before it binds its views.
- Staging and trash left by dead processes are removed by ``recover`` as well, and so are the
  hidden temporary files (``tmp_name``: a segment, the lake marker, a journal being written)
  that a killed writer left in the lake.

Liveness is judged by process id on the same host; a journal or staging directory written
on another host (a lake on a shared filesystem) is left alone and logged.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "STAGING",
    "TRASH",
    "fsync_path",
    "recover",
    "remove_dead_tmp",
    "staging_token",
    "swap_in",
    "tmp_name",
    "wait_for_commits",
]

log = logging.getLogger(__name__)

STAGING = ".staging"
TRASH = ".trash"
_JOURNAL = ".journal"
_HOST = socket.gethostname()
# ``.<name>.<token>.tmp`` and what DuckDB adds to a database file's name (``.wal``, ``.tmp/``).
_TMP_RE = re.compile(r"^\..+\.(?P<token>\d+-.+-\d+-[0-9a-f]{8})\.tmp(?:\..+)?$")
# Where writers put temporary files inside a lake (segments, the marker, journals).
_LAKE_TMP_GLOBS = (".*.tmp", f"{_JOURNAL}/.*.tmp", "*/scenario=*/date=*/.*.tmp")


def staging_token() -> str:
    """A name for one writer's staging or trash directory: ``<ns>-<host>-<pid>-<random>``."""
    return f"{time.time_ns()}-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def tmp_name(name: str) -> str:
    """A hidden temporary name beside ``name`` that says which process writes it."""
    return f".{name}.{staging_token()}.tmp"


def _dead_owner(token: str) -> int | None:
    owner = _owner(token)
    return owner[1] if owner is not None and not _alive(*owner) else None


def remove_dead_tmp(paths: Iterable[Path]) -> int:
    """Remove the ``tmp_name`` files and directories among ``paths`` whose writer is dead."""
    removed = 0
    for path in paths:
        m = _TMP_RE.match(path.name)
        pid = _dead_owner(m.group("token")) if m else None
        if pid is None:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed += 1
        log.info("removed %s, left by dead process %d", path, pid)
    return removed


def _owner(token: str) -> tuple[str, int] | None:
    parts = token.split("-")
    if len(parts) < 4 or not parts[-2].isdigit():
        return None
    return "-".join(parts[1:-2]), int(parts[-2])


def _alive(host: str, pid: int) -> bool:
    if host != _HOST:
        return True  # cannot tell from here: treat as alive, leave it be
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fsync_path(path: Path) -> None:
    """Flush what was written to ``path`` to stable storage: a file's contents, or a directory's
    entries (after a rename into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_journal(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(tmp_name(path.name))
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def _swap_one(entry: dict[str, Any]) -> None:
    final = Path(entry["final"])
    final.parent.mkdir(parents=True, exist_ok=True)
    if entry["had_old"]:
        Path(entry["trash"]).parent.mkdir(parents=True, exist_ok=True)
        os.replace(final, entry["trash"])
    if entry["staged"] is not None:  # (None: the old path is only removed)
        os.replace(entry["staged"], final)
    fsync_path(final.parent)


def _undo(entries: Sequence[dict[str, Any]]) -> None:
    """Put every path back as it was before the swap; safe to run twice."""
    for e in reversed(entries):
        final, trash = Path(e["final"]), Path(e["trash"])
        staged = None if e["staged"] is None else Path(e["staged"])
        if staged is not None and not staged.exists() and final.exists() \
                and (trash.exists() or not e["had_old"]):
            staged.parent.mkdir(parents=True, exist_ok=True)
            os.replace(final, staged)  # the new directory goes back to staging
        if trash.exists() and not final.exists():
            os.replace(trash, final)


def swap_in(lake: Path, pairs: Sequence[tuple[Path | None, Path]]) -> None:
    """Move each staged path (a directory, or a file) onto its final path, all or none (see the
    module docstring); a pair staged None removes its final path (to trash, undone the same way):
    a compaction's merged segment replaces one segment and removes the others in one commit."""
    token = staging_token()
    entries = [{"staged": None if staged is None else str(staged), "final": str(final),
                "trash": str(lake / TRASH / token / str(i)), "had_old": final.exists()}
               for i, (staged, final) in enumerate(pairs)]
    journal = lake / _JOURNAL / f"{token}.json"
    _write_journal(journal, {"host": _HOST, "pid": os.getpid(), "entries": entries})
    try:
        for entry in entries:
            _swap_one(entry)
    except BaseException:
        _undo(entries)
        journal.unlink(missing_ok=True)
        raise
    journal.unlink()  # the commit point
    fsync_path(journal.parent)
    shutil.rmtree(lake / TRASH / token, ignore_errors=True)


def _live_journals(lake: Path) -> list[Path]:
    live = []
    for path in sorted((lake / _JOURNAL).glob("*.json")):
        owner = _owner(path.stem)
        if owner is not None and _alive(*owner):
            live.append(path)
    return live


def recover(lake: Path) -> int:
    """Undo the commits of dead processes and remove their staging and trash; returns how many."""
    undone = 0
    for path in sorted((lake / _JOURNAL).glob("*.json")):
        owner = _owner(path.stem)
        if owner is None or _alive(*owner):
            continue
        record = json.loads(path.read_text())
        _undo(record["entries"])
        path.unlink()
        undone += 1
        log.warning("lake %s: undid an unfinished commit of dead process %d (%s)", lake, owner[1], path.name)
    for folder in (lake / STAGING, lake / TRASH):
        for leftover in sorted(folder.glob("*")) if folder.is_dir() else []:
            pid = _dead_owner(leftover.name)
            if pid is not None:
                shutil.rmtree(leftover, ignore_errors=True)
                log.info("lake %s: removed %s left by dead process %d", lake, leftover, pid)
    for pattern in _LAKE_TMP_GLOBS:
        remove_dead_tmp(lake.glob(pattern))
    return undone


def wait_for_commits(lake: Path, timeout_s: float = 10.0) -> bool:
    """Wait until no live process is mid-commit in ``lake``; False if one still is at the timeout."""
    deadline = time.monotonic() + timeout_s
    while _live_journals(lake):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True
