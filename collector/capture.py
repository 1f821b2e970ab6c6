"""Collector for recorded engine frames: the capture file ``--record`` writes, ``import vllm-events`` reads.

One line per ZMQ message: a JSON list of the base64 of each frame (``[topic, seq, payload]`` as
published, or ``[b"", seq, payload]`` for a batch that came through the replay), the format of
the vllm-cpu-capture data (``../data/vllm-cpu-capture/``). Decoding the frames is
collector/vllm_events.py's.
"""

from __future__ import annotations

import base64
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow as pa

from kvlens.collector.fields import checked_lines
from kvlens.collector.vllm_events import DecodeError, EventDecoder, KvColumns, split_frames, topic_replica
from kvlens.errors import InputError

__all__ = ["capture_line", "import_capture", "read_capture"]

log = logging.getLogger("kvlens.collector.vllm_events")


def capture_line(frames: Sequence[bytes]) -> bytes:
    """One capture line: a JSON list of the base64 of each frame (the vllm-cpu-capture format)."""
    return json.dumps([base64.b64encode(bytes(f)).decode() for f in frames]).encode() + b"\n"


def read_capture(path: str | os.PathLike[str]) -> Iterator[tuple[int, list[bytes]]]:
    """(line number, frames) of each line of a capture file, plain or gzip (``.gz``)."""
    for lineno, line, _ in checked_lines(Path(path)):
        if not line:
            continue
        try:
            items = json.loads(line)
            frames = [base64.b64decode(x, validate=True) for x in items]
        except (ValueError, TypeError, RecursionError) as e:
            raise InputError(f"not a JSON list of base64 frames ({e})", path=str(path),
                             line=lineno) from None
        yield lineno, frames


def import_capture(paths: Sequence[str | os.PathLike[str]], lake: str | os.PathLike[str], *,
                   scenario: str = "default", replica: str | None = None, model: str | None = None,
                   keep_tokens: bool = False) -> dict[str, int]:
    """Import recorded frames files into ``kv_events`` of ``scenario`` (replaced whole).

    Batches are taken in file order; a repeated (replica, seq) is dropped; bad frames are
    counted, logged and skipped. Returns counts.
    """
    from kvlens.lake import SegmentWriter

    decoder = EventDecoder(keep_tokens=keep_tokens)
    cols = KvColumns(keep_tokens)
    seen: set[tuple[str, int]] = set()
    counts = {"batches": 0, "rows": 0, "bad_frames": 0, "bad_events": 0, "duplicates": 0}
    with SegmentWriter(lake, "kv_events", scenario=scenario, writer_id="import-vllm-events",
                       replace=True) as w:
        for path in paths:
            if not Path(path).is_file():
                raise InputError("no such file: check the path", path=str(path))
            for lineno, frames in read_capture(path):
                try:
                    topic, seq, payload = split_frames(frames)
                    name, topic_model = topic_replica(topic)
                    rep = replica or name or topic.decode("utf-8", "replace") or Path(path).stem
                    if (rep, seq) in seen:
                        counts["duplicates"] += 1
                        continue
                    info = decoder.decode(payload, cols, replica=rep, seq=seq, recv_ns=0,
                                          namespace=model or topic_model)
                except DecodeError as e:
                    counts["bad_frames"] += 1
                    log.warning("%s:%d: skipped frame: %s", path, lineno, e)
                    continue
                seen.add((rep, seq))
                counts["batches"] += 1
                counts["rows"] += info.rows
                counts["bad_events"] += len(info.bad_events)
                if len(cols) >= 200_000:
                    w.append_arrow(_recv_as_ts(cols.take_arrow()))
        if len(cols):
            w.append_arrow(_recv_as_ts(cols.take_arrow()))
    counts["unannounced_parents"] = decoder.unannounced_parents
    return counts


def _recv_as_ts(t: pa.Table) -> pa.Table:
    # a capture has no receive times
    return t.set_column(t.schema.get_field_index("recv_ns"), "recv_ns", t.column("ts_ns"))
