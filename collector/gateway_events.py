"""Collector (kvlens gateway): each replica's resident GPU blocks, followed from its own KV-event stream.

``cache_aware`` routing asks, for each replica, how long a prefix of the prompt's full blocks is
resident there now. The gateway subscribes to every replica's KV-event PUB endpoint itself (a
second subscriber beside ``kvlens collect vllm``: ZMQ PUB sockets fan out) and keeps one set of
block hashes per replica: ``BlockStored`` on the GPU tier adds, ``BlockRemoved`` discards,
``AllBlocksCleared`` empties (collector/vllm_events.py decodes every form). The sets are bounded
by the engines' own block pools; a stream that cannot be decoded is counted and skipped.

An event batch is published after the engine step that made it (vllm/v1/core/kv_cache_manager.py
``take_events``, drained by the engine core after each ``schedule``), so the view lags the engine
by at most one step plus the loopback hop: routing is a heuristic, the ledger is not.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import zmq

from kvlens.collector.vllm_events import DecodeError, EventDecoder, KvColumns, split_frames
from kvlens.config import ReplicaConfig
from kvlens.errors import ConfigError

__all__ = ["ResidentBlocks"]

log = logging.getLogger(__name__)

_POLL_MS = 100
_CHAIN_CAPACITY = 200_000


class ResidentBlocks:
    """Per replica (by index), the set of block hashes resident on its GPU tier; ``matched`` reads it."""

    def __init__(self, replicas: Sequence[ReplicaConfig], *,
                 context: zmq.Context[Any] | None = None) -> None:
        for r in replicas:
            if r.bind:
                raise ConfigError(f"replica {r.name}: with bind = true its engine publishes to one collector "
                                  f"at {r.endpoint}, so cache_aware cannot subscribe: let the engine bind")
        self.replicas = list(replicas)
        self.blocks: list[set[int]] = [set() for _ in replicas]
        self.batches = [0] * len(replicas)
        self.decode_errors = 0
        self._ctx = context or zmq.Context.instance()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvlens-gateway-events", daemon=True)
        self._socks: list[zmq.Socket[Any]] = []

    def start(self) -> None:
        for r in self.replicas:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, r.topic.encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(r.endpoint)
            self._socks.append(sock)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def matched(self, replica: int, full_hashes: Sequence[int]) -> int:
        """How many leading full blocks of the prompt are resident on ``replica`` now."""
        resident = self.blocks[replica]
        n = 0
        for h in full_hashes:
            if h not in resident:
                break
            n += 1
        return n

    def apply(self, replica: int, payload: bytes, decoder: EventDecoder) -> None:
        """One event batch of ``replica`` applied to its set."""
        out = KvColumns()
        decoder.decode(payload, out, replica=self.replicas[replica].name or str(replica), seq=0, recv_ns=0)
        cols = out.take()
        resident = self.blocks[replica]
        for kind, h, medium in zip(cols["kind"], cols["block_hash"], cols["medium"], strict=True):
            if kind == "cleared":
                resident.clear()
            elif medium not in (None, "gpu"):
                continue
            elif kind == "stored":
                resident.add(h)
            elif kind == "removed":
                resident.discard(h)
        self.batches[replica] += 1

    def _loop(self) -> None:
        poller = zmq.Poller()
        for sock in self._socks:
            poller.register(sock, zmq.POLLIN)
        decoders = [EventDecoder(chain_capacity=_CHAIN_CAPACITY) for _ in self._socks]
        index = {sock: i for i, sock in enumerate(self._socks)}
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(_POLL_MS):
                    i = index[sock]
                    self._receive(i, sock.recv_multipart(), decoders[i])
        finally:
            for sock in self._socks:
                sock.close(linger=0)

    def _receive(self, i: int, frames: list[bytes], decoder: EventDecoder) -> None:
        try:
            _, _, payload = split_frames(frames)
            self.apply(i, payload, decoder)
        except DecodeError as e:
            self.decode_errors += 1
            log.warning("gateway: replica %s sent an event batch that does not decode (%s); skipped",
                        self.replicas[i].name, e)
        except Exception:  # never let one batch stop routing
            self.decode_errors += 1
            log.exception("gateway: replica %s's event batch failed; skipped", self.replicas[i].name)
