"""Collector side-files for what was accepted but cannot be written: ``LAKE/.quarantine/``.

A long-running collector never drops what it accepted and never dies on it. Rows that the lake
writer refuses (a value past its column that slipped through a decoder) are written here as
JSON lines, one file per spill, named ``<writer>-<ns>.jsonl``, and the spill is logged and
counted by the caller, so that an operator can see what was kept aside and why. Files are
written to a hidden temporary name, fsynced, then renamed, like lake segments; nothing reads
them back (the lake's globs never match this folder).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["QUARANTINE", "spill_rows"]

QUARANTINE = ".quarantine"


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, float) and value != value:  # NaN has no JSON form
        return "NaN"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return str(value)
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return repr(value)


def spill_rows(lake: str | os.PathLike[str], writer_id: str, table: str, rows: Iterable[Mapping[str, Any]],
               reason: str) -> Path:
    """Write ``rows`` of ``table`` aside as JSON lines (each with the reason); the file's path."""
    folder = Path(lake) / QUARANTINE
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{writer_id}-{time.time_ns():020d}.jsonl"
    tmp = folder / f".{path.name}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            line = {"table": table, "reason": reason, "row": _jsonable(row)}
            f.write(json.dumps(line, ensure_ascii=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
