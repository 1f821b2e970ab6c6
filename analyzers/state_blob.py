"""The one layout of an analyzer's saved state in the analysis DB: a little-endian 4-byte length, a
JSON head, then Arrow IPC frames (zstd) whose byte lengths the head lists under ``sizes``."""

from __future__ import annotations

import io
import json
from concurrent.futures import Future
from typing import Any, TypeAlias, TypeVar

import polars as pl

__all__ = ["Pending", "pack", "ready", "still_counted", "unpack"]

T = TypeVar("T")
# A saved state read back now, or on a worker thread (analyzers/incremental.py ``StateWorker``).
Pending: TypeAlias = "T | Future[T | None] | None"


def ready(state: Pending[T]) -> T | None:
    """``state``, waiting for it when it is being read on a worker thread."""
    return state.result() if isinstance(state, Future) else state


def pack(head: dict[str, Any], frames: dict[str, pl.DataFrame]) -> bytes:
    """``head`` (JSON-serializable) and ``frames`` as one blob (``unpack`` reads it)."""
    blobs = {}
    for name, frame in frames.items():
        buf = io.BytesIO()
        frame.write_ipc(buf, compression="zstd")
        blobs[name] = buf.getvalue()
    text = json.dumps({**head, "sizes": {k: len(v) for k, v in blobs.items()}}).encode()
    return len(text).to_bytes(4, "little") + text + b"".join(blobs.values())


def unpack(data: bytes) -> tuple[dict[str, Any], dict[str, pl.DataFrame]]:
    """(head, frames) of a ``pack`` blob; ValueError when it is cut short."""
    size = int.from_bytes(data[:4], "little")
    head = json.loads(data[4:4 + size])
    at, frames = 4 + size, {}
    for name, length in head.pop("sizes").items():
        if at + length > len(data):
            raise ValueError(f"state blob cut short: frame {name} needs {length} bytes at {at}, "
                             f"the blob has {len(data)}")
        frames[name] = pl.read_ipc(io.BytesIO(data[at:at + length]))
        at += length
    return head, frames


def still_counted(unchanged_before: int | None, checkpoint_ns: int) -> bool:
    """Whether a state's count of a lake table's rows stamped before ``checkpoint_ns`` still holds
    without a scan: the table holds, before ``unchanged_before``, the rows it held when the state
    was saved (analyzers/incremental.py, ``new_rows_from``; None: not known)."""
    return unchanged_before is not None and checkpoint_ns <= unchanged_before
