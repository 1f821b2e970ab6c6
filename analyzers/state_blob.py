"""The one layout of an analyzer's saved state in the analysis DB: a little-endian 4-byte length, a
JSON head, then Arrow IPC frames (zstd) whose byte lengths the head lists under ``sizes``
(``pack``), or zstd-compressed NumPy arrays whose dtypes, shapes and byte lengths it lists under
``arrays`` (``pack_arrays``: the ledger's replay state, plain arrays read straight into the
compiled replay)."""

from __future__ import annotations

import io
import json
import zlib
from concurrent.futures import Future
from typing import Any, TypeAlias, TypeVar

import numpy as np
import polars as pl
import pyarrow as pa

__all__ = ["Pending", "pack", "pack_arrays", "ready", "still_counted", "unpack", "unpack_arrays"]

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
    return _joined({**head, "sizes": {k: len(v) for k, v in blobs.items()}}, list(blobs.values()))


def unpack(data: bytes) -> tuple[dict[str, Any], dict[str, pl.DataFrame]]:
    """(head, frames) of a ``pack`` blob; ValueError when it is cut short."""
    head, at = _head(data)
    frames = {}
    for name, length in head.pop("sizes").items():
        if at + length > len(data):
            raise ValueError(f"state blob cut short: frame {name} needs {length} bytes at {at}, "
                             f"the blob has {len(data)}")
        frames[name] = pl.read_ipc(io.BytesIO(data[at:at + length]))
        at += length
    return head, frames


# zstd at level 1: on the whole sample trace's 6th increment the ledger state (9.3 MB of arrays)
# packs in 18 ms to 0.79 MB and unpacks in 9 ms (its CRC-32s checked), where a deflated .npz
# (level 1) took 40 and 15 ms for 0.96 MB (measured here).
_ZSTD_LEVEL = 1


def _head(data: bytes) -> tuple[dict[str, Any], int]:
    size = int.from_bytes(data[:4], "little")
    return json.loads(data[4:4 + size]), 4 + size


def _joined(head: dict[str, Any], blobs: list[bytes]) -> bytes:
    text = json.dumps(head).encode()
    return len(text).to_bytes(4, "little") + text + b"".join(blobs)


def pack_arrays(head: dict[str, Any], arrays: dict[str, np.ndarray]) -> bytes:
    """``head`` (JSON-serializable) and ``arrays`` (numeric, any shape) as one blob
    (``unpack_arrays`` reads it)."""
    codec = pa.Codec("zstd", compression_level=_ZSTD_LEVEL)
    blobs, listed = [], {}
    for name, array in arrays.items():
        a = np.ascontiguousarray(array)
        if a.dtype.hasobject:
            raise TypeError(f"state array {name} holds Python objects")
        blob = codec.compress(a.tobytes(), asbytes=True)
        blobs.append(blob)
        listed[name] = {"dtype": a.dtype.str, "shape": list(a.shape), "size": len(blob),
                        "crc32": zlib.crc32(blob)}
    return _joined({**head, "arrays": listed}, blobs)


def unpack_arrays(data: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(head, arrays) of a ``pack_arrays`` blob; ValueError when it is cut short or damaged."""
    head, at = _head(data)
    codec = pa.Codec("zstd")
    arrays = {}
    for name, spec in head.pop("arrays").items():
        dtype, shape, length = np.dtype(spec["dtype"]), tuple(spec["shape"]), int(spec["size"])
        if at + length > len(data):
            raise ValueError(f"state blob cut short: array {name} needs {length} bytes at {at}, "
                             f"the blob has {len(data)}")
        payload = data[at:at + length]
        if zlib.crc32(payload) != spec["crc32"]:  # (zstd's frames carry no checksum here)
            raise ValueError(f"state blob damaged: array {name} fails its CRC-32")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        try:
            raw = codec.decompress(payload, decompressed_size=nbytes, asbytes=True)
        except pa.ArrowException as e:
            raise ValueError(f"state blob damaged: array {name}: {e}") from None
        # (a writable copy: the replay and the state's updates may write into them)
        arrays[name] = np.frombuffer(raw, dtype).reshape(shape).copy()
        at += length
    return head, arrays


def still_counted(unchanged_before: int | None, checkpoint_ns: int) -> bool:
    """Whether a state's count of a lake table's rows stamped before ``checkpoint_ns`` still holds
    without a scan: the table holds, before ``unchanged_before``, the rows it held when the state
    was saved (analyzers/incremental.py, ``new_rows_from``; None: not known)."""
    return unchanged_before is not None and checkpoint_ns <= unchanged_before
