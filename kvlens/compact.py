"""The spine's compaction and retention: each closed day's segments merged into one, and raw
days past the retention dropped, each partition swapped in whole under the commit journal."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import re
import shutil
import time
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kvlens.commit import STAGING, staging_token, swap_in
from kvlens.damage import read_segment, segment_schema
from kvlens.errors import ConfigError
from kvlens.lake import lake_info
from kvlens.schema import LAKE_TABLES, arrow_schema

__all__ = ["compact", "drop_old_days", "parse_keep_days"]

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


def compact(lake: str | Path, *, today: str | None = None) -> dict[str, int]:
    """Merge the segments of each closed day (before ``today``, UTC) into one per partition.

    The partition directory is rebuilt under staging and swapped in whole. Returns counts.
    """
    root = Path(lake)
    _check_lake(root)
    today = today or time.strftime("%Y-%m-%d", time.gmtime())
    merged = removed = 0
    for table in LAKE_TABLES:
        for day_dir in sorted((root / table.name).glob("scenario=*/date=*")):
            files = sorted(day_dir.glob("*.parquet"))
            if day_dir.name[len("date="):] >= today or len(files) < 2:
                continue
            parts = [read_segment(f, arrow_schema(table)) for f in files]
            stage = root / STAGING / staging_token() / day_dir.name
            stage.mkdir(parents=True)
            data = pa.concat_tables(parts)
            last_meta = segment_schema(files[-1]).metadata or {}
            out = stage / files[-1].name  # keeps the newest name, so checkpoints still resolve
            with open(out, "wb") as f:
                pq.write_table(data.replace_schema_metadata(last_meta), f, compression="zstd")
                f.flush()
                os.fsync(f.fileno())
            swap_in(root, [(stage, day_dir)])
            shutil.rmtree(stage.parent, ignore_errors=True)
            merged += 1
            removed += len(files)
    return {"partitions_merged": merged, "segments_replaced": removed}


def _empty(path: Path) -> bool:
    return bool(pq.read_metadata(path).num_rows == 0)


def drop_old_days(lake: str | Path, keep_days: int, *, scenarios: tuple[str, ...] = (),
                  today: str | None = None) -> dict[str, int]:
    """Drop the raw partitions dated before ``today - keep_days`` (UTC), a whole day at a time: every
    row dropped is older than ``keep_days`` days, and the current day is never touched.

    Every table's partitions of one day (of ``scenarios``, default all) go in one commit
    (kvlens/commit.py's journal: a reader or a crash sees the day whole or gone, never one
    table without the other). Segments that hold no rows stay: they carry writers' checkpoints
    (an empty segment is dated 1970-01-01), and a collector that restarts resumes from them.
    The analysis DB is a separate file and is not touched. Returns counts.
    """
    root = Path(lake)
    _check_lake(root)
    if keep_days < 1:
        raise ConfigError(f"keep {keep_days} days: keep at least 1 (the current day is never dropped)")
    today = today or time.strftime("%Y-%m-%d", time.gmtime())
    # a day D is dropped when it ended at least keep_days before today began: its every row is older
    cutoff = (dt.date.fromisoformat(today) - dt.timedelta(days=keep_days)).isoformat()
    days: dict[str, list[Path]] = defaultdict(list)
    for table in LAKE_TABLES:
        for day_dir in sorted((root / table.name).glob("scenario=*/date=*")):
            scenario = day_dir.parent.name[len("scenario="):]
            if day_dir.name[len("date="):] < cutoff and (not scenarios or scenario in scenarios):
                days[day_dir.name].append(day_dir)
    dropped_days = partitions = segments = 0
    for day in sorted(days):
        stage_root = root / STAGING / staging_token()
        pairs, gone = [], 0
        for i, day_dir in enumerate(days[day]):
            files = sorted(day_dir.glob("*.parquet"))
            keep = [f for f in files if _empty(f)]
            if len(keep) == len(files):
                continue  # nothing but checkpoints: nothing to drop
            stage = stage_root / str(i) / day_dir.name
            stage.mkdir(parents=True)
            for f in keep:
                shutil.copy2(f, stage / f.name)
            pairs.append((stage, day_dir))
            gone += len(files) - len(keep)
        if pairs:
            swap_in(root, pairs)
            for _, day_dir in pairs:
                _remove_if_empty(day_dir)
            dropped_days += 1
            partitions += len(pairs)
            segments += gone
        shutil.rmtree(stage_root, ignore_errors=True)
    return {"days_dropped": dropped_days, "partitions_dropped": partitions, "segments_dropped": segments}


def _remove_if_empty(day_dir: Path) -> None:
    with contextlib.suppress(OSError):  # it still holds checkpoint segments
        day_dir.rmdir()
