"""The spine's compaction: the segments of each closed day merged into one, swapped in whole."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kvlens.commit import STAGING, staging_token, swap_in
from kvlens.damage import read_segment, segment_schema
from kvlens.errors import ConfigError
from kvlens.lake import lake_info
from kvlens.schema import LAKE_TABLES, arrow_schema

__all__ = ["compact"]


def compact(lake: str | Path, *, today: str | None = None) -> dict[str, int]:
    """Merge the segments of each closed day (before ``today``, UTC) into one per partition.

    The partition directory is rebuilt under staging and swapped in whole. Returns counts.
    """
    root = Path(lake)
    if not root.exists():
        raise ConfigError(f"lake {root} does not exist: pass the directory you import or collect into")
    lake_info(root)
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
