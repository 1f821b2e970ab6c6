"""Test helper: byte-exact engine KV-event frames (vLLM 0.33, 0.23, 0.9; SGLang) and a fake engine.

The structs mirror the engines' own msgspec definitions (FORMATS.md 1.2, 1.3, 2.1), so the
bytes are what those engines' encoders produce. ``FakeEngine`` publishes them on a real
pyzmq socket and serves the ROUTER replay protocol in either reply shape.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from typing import Any

import msgspec
import zmq

U64 = (1 << 64) - 1
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# -- vLLM 0.33: array batch, map events (tag under "type", defaults omitted) --------------------

class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class EventBatchWithPublisher(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Newer than 0.33: a trailing publisher_id element."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None
    publisher_id: bytes = b""


# -- vLLM 0.23: tagged positional arrays, fields 1-11 ------------------------------------------

class KVCacheEvent23(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored23(KVCacheEvent23, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved23(KVCacheEvent23, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared23(KVCacheEvent23, tag="AllBlocksCleared"):
    pass


# -- vLLM 0.9: 2-element batch, 5-field positional BlockStored ---------------------------------

class EventBatch09(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class BlockStored09(KVCacheEvent23, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class BlockRemoved09(KVCacheEvent23, tag="BlockRemoved"):
    block_hashes: list[int]


# -- SGLang 0.5: array batch without omit_defaults, map events, signed int64 hashes -------------

class SgEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class SgEvent(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class SgBlockStored(SgEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class SgBlockRemoved(SgEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class SgAllBlocksCleared(SgEvent, tag="AllBlocksCleared"):
    pass


_ENC = msgspec.msgpack.Encoder()


def encode(batch: msgspec.Struct) -> bytes:
    return _ENC.encode(batch)


def signed(h: int) -> int:
    """A uint64 as SGLang sends it (signed int64)."""
    return h - (1 << 64) if h >= 1 << 63 else h


class FakeEngine:
    """A publisher: XPUB (wire-identical to PUB; it also tells when a subscriber joined) and
    a ROUTER replay socket with a ring buffer, served from its own thread."""

    def __init__(self, ctx: zmq.Context[Any], topic: bytes = b"", *, old_replay: bool = False,
                 ring: int = 10_000, connect_to: str | None = None, hwm: int = 0,
                 sndbuf: int | None = None) -> None:
        self.topic, self.old_replay = topic, old_replay
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.SNDHWM, hwm)  # options apply to connections made after them
        if sndbuf:
            self.pub.setsockopt(zmq.SNDBUF, sndbuf)
        self.pub.setsockopt(zmq.LINGER, 0)
        if connect_to:
            self.pub.connect(connect_to)
            self.endpoint = connect_to
        else:
            self.pub.bind("tcp://127.0.0.1:*")
            self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.SNDHWM, 2 * (ring + 1))
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:*")
        self.replay = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.ring: deque[tuple[int, bytes]] = deque(maxlen=ring)
        self.lock = threading.Lock()
        self.seq = itertools.count()
        self.replay_requests = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def wait_subscribed(self, timeout_s: float = 10.0) -> None:
        if not self.pub.poll(int(timeout_s * 1000)):
            raise TimeoutError("no subscriber joined")
        self.pub.recv()

    def publish(self, payload: bytes, *, send: bool = True) -> int:
        """Buffer for replay and send (unless ``send`` is False: a batch dropped on the way)."""
        seq = next(self.seq)
        with self.lock:
            self.ring.append((seq, payload))
        if send:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def restart(self) -> None:
        """A new engine process: the sequence starts at 0 again and the ring is empty."""
        self.seq = itertools.count()
        with self.lock:
            self.ring.clear()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, start = frames
            self.replay_requests += 1
            first = int.from_bytes(start, "big")
            with self.lock:
                todo = [(s, p) for s, p in self.ring if s >= first]
            for s, p in todo:
                body = [s.to_bytes(8, "big"), p] if self.old_replay else [self.topic, s.to_bytes(8, "big"), p]
                self.router.send_multipart([ident, b"", *body])
            end = [END_SEQ, b""] if self.old_replay else [b"", END_SEQ, b""]
            self.router.send_multipart([ident, b"", *end])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.pub.close(0)
        self.router.close(0)
