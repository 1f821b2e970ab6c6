"""Collector decoder for engine KV-cache events: ZMQ frames -> ``kv_events`` rows (as columns).

Reads what vLLM (every release since 0.9) and SGLang publish (FORMATS.md sections 1-2, 6):

- multipart ``[topic, seq (8 bytes big-endian), payload]``;
- payload a msgpack array ``[ts, events, dp_rank, ...]``: a 2-element batch (vLLM 0.9) and
  trailing elements (``publisher_id`` in newer vLLM) are accepted; ``ts`` is float seconds,
  or int milliseconds (Mooncake Store) when it is too large to be seconds;
- events as maps with ``"type"`` (vLLM >= 0.24, SGLang) or tagged positional arrays
  (vLLM <= 0.23, of any of their lengths): ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``;
- block hashes normalised to unsigned 64-bit: ints masked (SGLang sends signed int64), byte
  digests reduced to their last 8 bytes big-endian;
- both engines' media mapped to the schema's tiers.

A ``BlockStored`` gets ``position`` and ``content_hash`` (kvlens's token-content chain, see
collector.hashing) when its parent chain is known: from the root, or from a parent seen
earlier (a bounded, two-generation map). Token ids are dropped unless ``keep_tokens``.
A bad batch raises ``DecodeError``; a bad event is counted, skipped, and the rest kept.

Every value is checked against its column at decode time (kvlens.limits), so no row that the
lake cannot hold is ever made: a batch time that is not finite or does not fit int64
nanoseconds, or a ``dp_rank`` outside [0, 2**31), makes the batch a DecodeError; a
``group_idx`` or ``block_size`` outside INTEGER, token ids outside INTEGER when they are kept,
or extra keys that are not plain nested lists of scalars (at most ``MAX_EXTRA_DEPTH`` deep)
make that event bad. Nesting deeper than Python's recursion limit anywhere in a payload is a
DecodeError (``depth``), not a RecursionError. A batch is decoded all or nothing into
``KvColumns``: a failure part-way leaves none of its rows behind.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa

from kvlens.collector.hashing import U64_MASK, content_hashes, event_hash, fold_u64
from kvlens.limits import INT32_MAX, INT64_MAX
from kvlens.schema import KV_EVENTS, EventKind, Medium, arrow_schema

__all__ = [
    "KV_COLUMNS",
    "MEDIA",
    "DecodeError",
    "EventDecoder",
    "KvColumns",
    "medium_of",
    "normalise_hash",
    "split_frames",
    "split_snapshot_reply",
]

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8
DEFAULT_MAX_PAYLOAD_BYTES = 16 * 2**20

KV_COLUMNS = (
    "ts_ns", "recv_ns", "replica", "dp_rank", "seq", "kind", "block_hash", "parent_hash", "position",
    "block_tokens", "medium", "group_idx", "spec_kind", "sliding_window_tokens", "remaining_copies",
    "lora_name", "extra_key", "content_hash", "namespace", "session_id", "locality",
)

# vLLM GPU/CPU/STORAGE; SGLang GPU/CPU_PINNED/DISK/EXTERNAL; Mooncake CPU/Disk; LMCache CPU.
MEDIA: dict[str, Medium] = {
    "GPU": Medium.GPU, "CUDA": Medium.GPU, "HBM": Medium.GPU,
    "CPU": Medium.CPU, "CPU_PINNED": Medium.CPU, "DRAM": Medium.CPU,
    "STORAGE": Medium.DISK, "DISK": Medium.DISK, "SSD": Medium.DISK,
    "EXTERNAL": Medium.POOL, "POOL": Medium.POOL, "REMOTE": Medium.POOL,
}

# Positional field order (vLLM <= 0.23, older SGLang); shorter arrays stop early.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                  "kv_cache_spec_sliding_window")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_TS_MS_ABOVE = 1e11  # seconds since 1970 stay below this until the year 5138
MAX_EXTRA_DEPTH = 8  # vLLM's extra keys nest 3 deep: [(("lora", name, path), ("cache_salt", s))]


class DecodeError(ValueError):
    """A frame or batch that cannot be read; ``reason`` is a short metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _BadEvent(ValueError):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def split_frames(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """(topic, seq, payload) of a live message ``[topic, seq, payload]``."""
    if len(frames) != 3:
        raise DecodeError("frames", f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq, payload = frames
    if len(seq) != 8:
        raise DecodeError("seq", f"sequence frame has {len(seq)} bytes, expected 8")
    return bytes(topic), int.from_bytes(seq, "big"), payload


def normalise_hash(value: Any) -> int:
    """An engine block hash as unsigned 64-bit (FORMATS.md section 6, item 4)."""
    if type(value) is int:
        return fold_u64(value)
    if isinstance(value, bytes | bytearray | memoryview) and len(value) > 0:
        return event_hash(bytes(value))
    raise _BadEvent("hash_type")


_MEDIUM_SEEN: dict[str, str] = {}  # engine spelling -> tier, bounded


def medium_of(value: Any) -> str:
    """The schema tier of an engine's medium string; None (older engines: the GPU pool) is gpu."""
    if value is None:
        return Medium.GPU.value
    if type(value) is not str:
        raise _BadEvent("medium_type")
    tier = _MEDIUM_SEEN.get(value)
    if tier is None:
        tier = MEDIA.get(value.upper(), Medium.UNKNOWN).value
        if len(_MEDIUM_SEEN) < 1000:
            _MEDIUM_SEEN[value] = tier
    return tier


# Columns that differ between the blocks of one event; every other column is one value per event.
_PER_BLOCK = ("block_hash", "parent_hash", "position", "extra_key", "content_hash")
_PER_EVENT = tuple(c for c in KV_COLUMNS if c not in _PER_BLOCK)


class KvColumns:
    """``kv_events`` rows accumulated as runs: one tuple of the per-event columns (in
    ``_PER_EVENT`` order) and a row count per event, and per-block lists for the rest. The
    Arrow conversion builds each per-event column once per event and repeats it in C, so a
    stored event of 16 blocks costs five list extends, not 16 tuples of 19 fields."""

    def __init__(self, keep_tokens: bool = False) -> None:
        self.keep_tokens = keep_tokens
        self.names = KV_COLUMNS + (("token_ids",) if keep_tokens else ())
        self._blocks = _PER_BLOCK + (("token_ids",) if keep_tokens else ())
        self._clear()

    def _clear(self) -> None:
        self.counts: list[int] = []
        self.events: list[tuple[Any, ...]] = []
        self.per_block: dict[str, list[Any]] = {c: [] for c in self._blocks}
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def mark(self) -> tuple[int, int, int]:
        """Where the buffer stands now, for ``rollback``."""
        return len(self.events), len(self.per_block["block_hash"]), self.n

    def rollback(self, mark: tuple[int, int, int]) -> None:
        """Drop every row added since ``mark``: a batch lands whole or not at all."""
        events, blocks, n = mark
        del self.events[events:], self.counts[events:]
        for values in self.per_block.values():
            del values[blocks:]
        self.n = n

    def add_event(self, event: tuple[Any, ...], n: int, hashes: Sequence[Any], parents: Sequence[Any],
                  positions: Sequence[Any], extras: Sequence[Any], contents: Sequence[Any],
                  tokens: Sequence[Any] | None = None) -> None:
        """``n`` rows sharing the per-event values ``event``; per-block values in sequences of n."""
        b = self.per_block
        b["block_hash"].extend(hashes)
        b["parent_hash"].extend(parents)
        b["position"].extend(positions)
        b["extra_key"].extend(extras)
        b["content_hash"].extend(contents)
        if self.keep_tokens:
            b["token_ids"].extend(tokens if tokens is not None else (None,) * n)
        self.events.append(event)
        self.counts.append(n)
        self.n += n

    def add(self, **values: Any) -> None:
        """One row from column values (the rest NULL); for rows the decoder does not make."""
        b = [(values.get(c),) for c in _PER_BLOCK]
        self.add_event(tuple(values.get(c) for c in _PER_EVENT), 1, b[0], b[1], b[2], b[3], b[4],
                       (values.get("token_ids"),) if self.keep_tokens else None)

    def take_arrow(self) -> pa.Table:
        """The rows as an Arrow table, and an empty buffer."""
        schema = arrow_schema(KV_EVENTS)
        repeat = pa.array(np.repeat(np.arange(len(self.counts), dtype=np.int64), self.counts))
        per_event = list(zip(*self.events, strict=True)) if self.events else [()] * len(_PER_EVENT)
        cols: dict[str, pa.Array] = {
            c: pa.array(v, type=schema.field(c).type).take(repeat)
            for c, v in zip(_PER_EVENT, per_event, strict=True)}
        cols.update({c: pa.array(v, type=schema.field(c).type) for c, v in self.per_block.items()})
        self._clear()
        return pa.table({c: cols[c] for c in self.names})

    def take_arrow_salvaged(self) -> tuple[pa.Table, list[dict[str, Any]]]:
        """``take_arrow`` event by event, for when it failed: (the rows Arrow takes, the rows it refuses)."""
        schema = arrow_schema(KV_EVENTS)
        good: list[pa.Table] = []
        refused: list[dict[str, Any]] = []
        start = 0
        for event, n in zip(self.events, self.counts, strict=True):
            head = dict(zip(_PER_EVENT, event, strict=True))
            rows = [{**head, **{c: v[j] for c, v in self.per_block.items()}} for j in range(start, start + n)]
            start += n
            try:
                good.append(pa.Table.from_pylist(rows, schema=schema))
            except (pa.ArrowException, OverflowError, TypeError, ValueError):
                refused.extend(rows)
        self._clear()
        table = pa.concat_tables(good) if good else schema.empty_table()
        return table.select(list(self.names)), refused

    def take(self) -> dict[str, list[Any]]:
        return self.take_arrow().to_pydict()


class _ChainMap:
    """engine hash -> (position, content hash); two generations bound the memory."""

    def __init__(self, capacity: int) -> None:
        self.half = max(1, capacity // 2)
        self.young: dict[int, tuple[int, int | None]] = {}
        self.old: dict[int, tuple[int, int | None]] = {}

    def get(self, h: int) -> tuple[int, int | None] | None:
        return self.young.get(h) or self.old.get(h)

    def put_many(self, hashes: Sequence[int], first_pos: int, contents: Sequence[int | None]) -> None:
        young = self.young
        young.update(zip(hashes, zip(range(first_pos, first_pos + len(hashes)), contents, strict=True),
                         strict=True))
        if len(young) >= self.half:
            self.old, self.young = young, {}


@dataclass
class BatchInfo:
    ts_ns: int
    dp_rank: int | None
    rows: int
    bad_events: list[str]


_STORED = EventKind.STORED.value
_REMOVED = EventKind.REMOVED.value
_CLEARED = EventKind.CLEARED.value
_INACTIVE = EventKind.INACTIVE.value


# The events as typed structs: msgspec validates every field in C, and unknown keys (newer
# engines) are ignored. Missing keys are None, as FORMATS.md section 6 asks.
class _Event(msgspec.Struct, tag_field="type", forbid_unknown_fields=False, gc=False):
    pass


class _Stored(_Event, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None = None
    token_ids: list[int] | None = None
    block_size: int | None = None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    session_id: str | None = None
    locality: str | None = None
    cache_salt: str | None = None  # SGLang


class _Removed(_Event, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    # Newer vLLM (PR #48933): physical copies of each hash left after the removal, aligned with
    # block_hashes; absent (None) where the producer cannot count them.
    remaining_copy_counts: list[int] | None = None


class _Cleared(_Event, tag="AllBlocksCleared"):
    pass


class _Inactive(_Event, tag="BlockInactive"):
    """Newer vLLM (PR #50732): the last request released a cached GPU block; it stays cached."""

    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None


_AnyEvent = _Stored | _Removed | _Cleared | _Inactive


class _Batch(msgspec.Struct, array_like=True, forbid_unknown_fields=False, gc=False):
    ts: float
    events: list[_AnyEvent]
    dp_rank: int | None = None


class EventDecoder:
    """Decodes payloads into a KvColumns; keeps the chain map across batches.

    Fast path: the whole batch decoded into typed structs at once (map events). Any batch
    that does not fit (positional events, one bad event) is decoded untyped and its events
    converted one by one, so one bad event costs only itself.
    """

    def __init__(self, *, keep_tokens: bool = False, chain_capacity: int = 1_000_000,
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:
        self.keep_tokens = keep_tokens
        self.max_payload_bytes = max_payload_bytes
        self._chains = _ChainMap(chain_capacity)
        # Stored events whose parent this decoder never saw stored (a P/D decode instance caches
        # blocks whose prefix came from the prefill side; a collector that joined late).
        self.unannounced_parents = 0
        self._decode = msgspec.msgpack.Decoder().decode
        self._typed = msgspec.msgpack.Decoder(_Batch).decode

    def read_batch(self, payload: bytes) -> tuple[int, list[Any], int | None]:
        """(ts_ns, events, dp_rank) of one payload, or DecodeError; events typed when they all fit."""
        if len(payload) > self.max_payload_bytes:
            raise DecodeError("oversize", f"payload of {len(payload):,} bytes exceeds the limit of "
                                          f"{self.max_payload_bytes:,}")
        try:
            b = self._typed(payload)
            return _ts_ns(b.ts), b.events, _dp_rank(b.dp_rank)
        except msgspec.ValidationError:
            pass
        except msgspec.DecodeError as e:
            raise DecodeError("msgpack", f"not msgpack: {e}") from None
        except RecursionError:
            raise DecodeError("depth", "payload nests deeper than the decoder's recursion limit") from None
        try:
            batch = self._decode(payload)
        except msgspec.DecodeError as e:
            raise DecodeError("msgpack", f"not msgpack: {e}") from None
        except RecursionError:
            raise DecodeError("depth", "payload nests deeper than the decoder's recursion limit") from None
        if not isinstance(batch, list) or len(batch) < 2:
            raise DecodeError("batch_shape", "batch is not an array [ts, events, ...]")
        ts, events = batch[0], batch[1]
        dp_rank = batch[2] if len(batch) > 2 else None
        if isinstance(ts, bool) or not isinstance(ts, int | float) or not isinstance(events, list):
            raise DecodeError("batch_types", "batch [ts, events] has wrong types")
        if dp_rank is not None and (isinstance(dp_rank, bool) or not isinstance(dp_rank, int)):
            raise DecodeError("batch_types", f"dp_rank is {type(dp_rank).__name__}, expected int")
        return _ts_ns(ts), events, _dp_rank(dp_rank)

    def decode(self, payload: bytes, out: KvColumns, *, replica: str, seq: int, recv_ns: int,
               namespace: str | None = None) -> BatchInfo:
        """Append the payload's rows to ``out``; raises DecodeError for an unreadable batch."""
        return self.decode_batch(self.read_batch(payload), out, replica=replica, seq=seq, recv_ns=recv_ns,
                                 namespace=namespace)

    def decode_batch(self, batch: tuple[int, list[Any], int | None], out: KvColumns, *, replica: str,
                     seq: int, recv_ns: int, namespace: str | None = None) -> BatchInfo:
        """Append the rows of a ``read_batch`` result to ``out``, all of them or (on an error) none."""
        mark = out.mark()
        try:
            return self._decode_events(batch, out, replica, seq, recv_ns, namespace)
        except BaseException:
            out.rollback(mark)
            raise

    def _decode_events(self, batch: tuple[int, list[Any], int | None], out: KvColumns, replica: str, seq: int,
                       recv_ns: int, namespace: str | None) -> BatchInfo:
        ts_ns, events, dp_rank = batch
        info = BatchInfo(ts_ns, dp_rank, 0, [])
        head = (ts_ns, recv_ns, replica, dp_rank, seq)
        stored, removed = self._stored, self._removed
        # Consecutive removals that share medium, group and locality become one run of rows
        # (vLLM sends one hash per BlockRemoved); an event joins the run only once it is valid.
        run: list[int] = []
        run_key: tuple[Any, ...] = ()
        for ev in events:
            try:
                if not isinstance(ev, _Event):
                    ev = _typed_event(ev)
                if type(ev) is _Removed and ev.remaining_copy_counts is not None:
                    if run:
                        info.rows += removed(run_key, run, out, head, namespace)
                        run = []
                    info.rows += self._removed_counted(ev, out, head, namespace)
                    continue
                if type(ev) is _Removed:
                    hashes = _hashes(ev.block_hashes)
                    key = (medium_of(ev.medium), _group(ev.group_idx), ev.locality)
                    if key != run_key and run:
                        info.rows += removed(run_key, run, out, head, namespace)
                        run = []
                    run_key = key
                    run.extend(hashes)
                    continue
                if run:
                    info.rows += removed(run_key, run, out, head, namespace)
                    run = []
                if type(ev) is _Stored:
                    info.rows += stored(ev, out, head, namespace)
                else:
                    none = (None,)
                    if type(ev) is _Inactive:
                        info.rows += self._inactive(ev, out, head, namespace)
                        continue
                    cleared = (*head, _CLEARED, *(None,) * 7, namespace, None, None)
                    out.add_event(cleared, 1, none, none, none, none, none)
                    info.rows += 1
            except _BadEvent as e:
                info.bad_events.append(e.reason)
        if run:
            info.rows += removed(run_key, run, out, head, namespace)
        return info

    def _stored(self, ev: _Stored, out: KvColumns, head: tuple[Any, ...], ns: str | None) -> int:
        hashes = _hashes(ev.block_hashes)
        n = len(hashes)
        if n == 0:
            return 0
        parent = None if ev.parent_block_hash is None else normalise_hash(ev.parent_block_hash)
        tokens, block_size = ev.token_ids, ev.block_size or None
        if block_size is not None and not 0 < block_size <= INT32_MAX:
            raise _BadEvent("field:block_size")
        group_idx, medium = _group(ev.group_idx), medium_of(ev.medium)
        lora = ev.lora_name if ev.lora_name is not None or ev.lora_id is None else str(ev.lora_id)
        aligned = tokens is not None and block_size is not None and len(tokens) == n * block_size
        extras = _extra_keys(ev.extra_keys, n, ev.cache_salt)
        if out.keep_tokens and tokens and aligned and not 0 <= min(tokens) <= max(tokens) <= INT32_MAX:
            raise _BadEvent("field:token_ids")  # kept ids are INTEGER[]; no tokenizer has ids past 2**31
        window = ev.kv_cache_spec_sliding_window
        if window is not None and not 0 < window <= INT32_MAX:
            raise _BadEvent("field:kv_cache_spec_sliding_window")
        positions, contents = self._chain(hashes, parent, tokens if aligned else None, block_size or 0)
        event = (*head, _STORED, block_size, medium, group_idx, ev.kv_cache_spec_kind,
                 window, None, lora, ns, ev.session_id, ev.locality)
        blocks = None
        if out.keep_tokens and tokens is not None and aligned:
            bs = block_size or 0
            blocks = [tokens[i * bs:(i + 1) * bs] for i in range(n)]
        out.add_event(event, n, hashes, [parent, *hashes[:-1]], positions, extras, contents, blocks)
        return n

    def _chain(self, hashes: list[int], parent: int | None, tokens: list[int] | None,
               block_size: int) -> tuple[Sequence[int | None], Sequence[int | None]]:
        n = len(hashes)
        parent_content: int | None = 0
        first = 0
        if parent is not None:
            known = self._chains.get(parent)
            if known is None:
                self.unannounced_parents += 1  # kept, with no position or content chain
                return (None,) * n, (None,) * n
            first, parent_content = known[0] + 1, known[1]
            if first + n > INT32_MAX:  # a chain longer than any prompt: its positions are not known
                return (None,) * n, (None,) * n
        contents: Sequence[int | None] = (None,) * n
        if tokens is not None and parent_content is not None:
            contents = content_hashes(tokens, block_size, parent_content) or contents
        self._chains.put_many(hashes, first, contents)
        return range(first, first + n), contents

    def _removed_counted(self, ev: _Removed, out: KvColumns, head: tuple[Any, ...], ns: str | None) -> int:
        """A removal that says how many copies of each hash remain: one row per hash with its count."""
        hashes, counts = _hashes(ev.block_hashes), ev.remaining_copy_counts or []
        if len(counts) != len(hashes) or not all(type(c) is int and 0 <= c <= INT32_MAX for c in counts):
            raise _BadEvent("remaining_copy_counts")
        none = (None,)
        medium = medium_of(ev.medium)
        for h, left in zip(hashes, counts, strict=True):
            known = self._chains.get(h) or (None, None)
            event = (*head, _REMOVED, None, medium, _group(ev.group_idx), None, None, left, None, ns, None,
                     ev.locality)
            out.add_event(event, 1, (h,), none, (known[0],), none, (known[1],))
        return len(hashes)

    def _inactive(self, ev: _Inactive, out: KvColumns, head: tuple[Any, ...], ns: str | None) -> int:
        """Rows of kind ``inactive``: cached blocks no request references any more (still resident)."""
        hashes = _hashes(ev.block_hashes)
        n = len(hashes)
        if n:
            none = (None,) * n
            event = (*head, _INACTIVE, None, medium_of(ev.medium), _group(ev.group_idx), None, None, None,
                     None, ns, None, ev.locality)
            out.add_event(event, n, hashes, none, none, none, none)
        return n

    def decode_snapshot(self, payloads: Sequence[bytes], out: KvColumns, *, replica: str, seq: int,
                        recv_ns: int, namespace: str | None = None) -> BatchInfo:
        """A publisher's snapshot (``split_snapshot_reply``): a ``cleared`` row, then its chunks' stores.

        The snapshot replaces whatever was known of the replica's cache; every row carries ``seq``,
        the last live sequence the snapshot includes, so live batches resume after it.
        """
        first = self.read_batch(payloads[0])[0] if payloads else recv_ns
        info = BatchInfo(first, None, 1, [])
        none = (None,)
        out.add_event((first, recv_ns, replica, None, seq, _CLEARED, *(None,) * 7, namespace, None, None), 1,
                      none, none, none, none, none)
        for payload in payloads:
            part = self.decode(payload, out, replica=replica, seq=seq, recv_ns=recv_ns, namespace=namespace)
            info.rows += part.rows
            info.bad_events += part.bad_events
        return info

    def _removed(self, key: tuple[Any, ...], hashes: list[int], out: KvColumns, head: tuple[Any, ...],
                 ns: str | None) -> int:
        """Rows for a run of removed hashes sharing ``key`` = (tier, group_idx, locality)."""
        n = len(hashes)
        get = self._chains.get
        known = [get(h) or (None, None) for h in hashes]
        none = (None,) * n
        medium, group_idx, locality = key
        event = (*head, _REMOVED, None, medium, group_idx, None, None, None, None, ns, None, locality)
        out.add_event(event, n, hashes, none, [k[0] for k in known], none, [k[1] for k in known])
        return n


def split_snapshot_reply(frames: Sequence[bytes]) -> tuple[int, bytes, list[bytes]]:
    """(seq, publisher_id, chunk payloads) of a snapshot reply (newer vLLM, PR #57789).

    The client sends ``b"snapshot"`` to the snapshot endpoint; the reply is ``[seq (8 bytes
    big-endian, signed), publisher_id (16 bytes), chunk...]``, each chunk a batch payload as the
    live stream sends. ``seq`` is the last live sequence the snapshot includes (-1: none yet); a
    lower value means no snapshot is available (vLLM's examples/features/kv_events/
    kv_events_snapshot_subscriber.py::SnapshotClient.bootstrap).
    """
    if len(frames) < 2 or len(frames[0]) != 8 or len(frames[1]) != 16:
        raise DecodeError("snapshot", "expected [seq (8 bytes), publisher_id (16 bytes), chunk...]")
    seq = int.from_bytes(frames[0], "big", signed=True)
    if seq < -1:
        raise DecodeError("snapshot", f"the publisher has no snapshot to give (sequence {seq})")
    return seq, bytes(frames[1]), [bytes(f) for f in frames[2:]]


def _hashes(raw: list[Any]) -> list[int]:
    """Block hashes as unsigned 64-bit; non-negative ints (vLLM's usual form) pass as they are."""
    try:
        if not raw or min(raw) >= 0:
            return raw  # msgpack ints are below 2**64, so non-negative ones are already uint64
    except TypeError:  # bytes digests, or a mix
        pass
    return [h & U64_MASK if type(h) is int else normalise_hash(h) for h in raw]  # fold_u64, inlined


def _ts_ns(ts: float) -> int:
    """Engine seconds (or Mooncake Store milliseconds) as int64 ns since the epoch, or DecodeError."""
    if not math.isfinite(ts) or ts < 0:
        raise DecodeError("ts", f"batch time {ts!r} is not a time since the epoch")
    scaled = ts * 1_000_000 if ts > _TS_MS_ABOVE else ts * 1e9  # inf past 1.8e302: compare, then convert
    if not scaled <= INT64_MAX:
        raise DecodeError("ts", f"batch time {ts!r} is past the int64 nanosecond range (year 2262)")
    return int(scaled)


def _dp_rank(value: int | None) -> int | None:
    if value is not None and not 0 <= value <= INT32_MAX:
        raise DecodeError("dp_rank", f"dp_rank {value} is outside [0, 2**31)")
    return value


def _group(value: int | None) -> int | None:
    if value is not None and not 0 <= value <= INT32_MAX:
        raise _BadEvent("field:group_idx")
    return value


def _typed_event(ev: Any) -> _Event:
    """One untyped event (a map, or a vLLM <= 0.23 tagged array) as its struct, or _BadEvent."""
    if type(ev) is list and ev:
        tag = ev[0] if type(ev[0]) is str else ""
        fields = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS}.get(tag, ())
        ev = {"type": ev[0], **dict(zip(fields, ev[1:], strict=False))}
    if type(ev) is not dict:
        raise _BadEvent("event_shape")
    try:
        return msgspec.convert(ev, _AnyEvent, builtin_types=(bytes,))
    except RecursionError:
        raise _BadEvent("depth") from None
    except msgspec.ValidationError as e:
        where = str(e).rsplit("`", 2)[-2] if "`$" in str(e) else ""
        field = re.sub(r"\[[^\]]*\]", "", where.removeprefix("$.")).split(".")[0]  # a bounded label
        raise _BadEvent("event_type" if where == "$.type" else f"field:{field}") from None


def _extra_keys(extra: list[Any] | None, n: int, salt: str | None) -> Sequence[str | None]:
    """Each block's published extra keys as compact JSON text (SGLang: its cache salt)."""
    if extra is None or not any(extra):
        return (salt,) * n
    return [None if e is None else _extra_text(e) for e in (extra[:n] + [None] * (n - len(extra)))]


_SCALARS = (str, int, float, bool, bytes, type(None))


def _extra_text(key: Any) -> str:
    """One block's extra keys as JSON: nested lists of scalars (bytes as base64), or _BadEvent."""
    todo = [(key, 1)]
    while todo:
        value, depth = todo.pop()
        if type(value) is list or type(value) is tuple:
            if depth > MAX_EXTRA_DEPTH:
                raise _BadEvent("field:extra_keys")
            todo.extend((v, depth + 1) for v in value)
        elif type(value) not in _SCALARS or (type(value) is float and not math.isfinite(value)):
            raise _BadEvent("field:extra_keys")  # a msgpack ext type, a map, NaN: not a cache key
    return msgspec.json.encode(key).decode()


def topic_replica(topic: bytes) -> tuple[str | None, str | None]:
    """(replica, model) from an llm-d style topic ``kv@<pod>@<model>``; (None, None) otherwise."""
    parts = topic.decode("utf-8", "replace").split("@")
    if len(parts) >= 3 and parts[0] == "kv" and parts[1]:
        return parts[1], "@".join(parts[2:]) or None
    return None, None
