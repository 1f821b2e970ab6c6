"""Collector (kvlens gateway): a bounded queue of recorded requests -> requests + request_blocks segments.

The proxy hands each finished request (one ``requests`` row and its ``request_blocks`` rows) to
``put``; one thread appends them to two lake writers and commits a segment of each

- every ``flush_age_s`` seconds (the time bound) and every ``flush_requests`` requests (the
  size bound), whichever comes first; ``request_blocks`` first, then ``requests``, so a
  committed request always has its blocks;
- so a ``kill -9`` loses at most the requests finished in the last ``flush_age_s`` seconds, and
  never more than ``flush_requests`` + ``queue_requests`` of them (README, "Run kvlens in front
  of your fleet").

The queue holds at most ``queue_requests``; when it is full, ``put`` waits (the proxy's handler
waits with it, so a client's request does not complete until its row is accepted): back-pressure,
never unbounded memory. A lake write that fails (disk full) is logged, counted and retried with
back-off; its rows stay buffered, and past ``flush_requests`` buffered the thread stops taking
from the queue, which fills. ``stop`` drains and commits.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlens.lake import SegmentWriter

__all__ = ["Recorded", "RequestWriter"]

log = logging.getLogger(__name__)

_TICK_S = 0.05


@dataclass
class Recorded:
    request: dict[str, Any]
    blocks: list[dict[str, Any]] = field(default_factory=list)


class RequestWriter:
    """``start`` / ``put`` / ``stop``; ``on_written(table, rows)`` and ``on_error()`` feed the metrics."""

    def __init__(self, lake: str | Path, *, scenario: str, writer_id: str, flush_age_s: float = 1.0,
                 flush_requests: int = 1024, queue_requests: int = 4096,
                 on_written: Any = None, on_error: Any = None) -> None:
        self.flush_age_s, self.flush_requests = flush_age_s, flush_requests
        self.queue: queue.Queue[Recorded] = queue.Queue(queue_requests)
        never = 1 << 62  # this class decides when to flush, not the writers
        self.blocks = SegmentWriter(lake, "request_blocks", scenario=scenario, writer_id=writer_id,
                                    flush_rows=never)
        self.requests = SegmentWriter(lake, "requests", scenario=scenario, writer_id=writer_id,
                                      flush_rows=never)
        self._on_written = on_written or (lambda table, n: None)
        self._on_error = on_error or (lambda: None)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvlens-gateway-writer", daemon=True)
        self._buffered = 0
        self._oldest: float | None = None
        self._retry_at = 0.0
        self._failures = 0

    def start(self) -> None:
        self._thread.start()

    def put(self, item: Recorded, timeout_s: float | None = None) -> bool:
        """Queue one request; waits while the queue is full (False after ``timeout_s``)."""
        try:
            self.queue.put(item, timeout=timeout_s)
        except queue.Full:
            return False
        return True

    def offer(self, item: Recorded) -> bool:
        """Queue one request if there is room now."""
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            return False
        return True

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stopping.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("gateway writer still busy after %.0f s; %d requests not committed", timeout_s,
                      self._buffered + self.queue.qsize())

    @property
    def depth(self) -> int:
        """Requests queued or buffered and not yet committed."""
        return self.queue.qsize() + self._buffered

    # -- the thread -------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            stopping = self._stopping.is_set()
            if self._buffered < self.flush_requests or stopping:
                try:
                    self._take(self.queue.get(timeout=0 if stopping else _TICK_S))
                except queue.Empty:
                    if stopping:
                        break
            else:
                self._stopping.wait(_TICK_S)  # the lake refuses: let the queue fill (back-pressure)
            if self._due():
                self._flush()
        for _ in range(4):
            self._retry_at = 0.0
            if self._flush():
                return
            time.sleep(0.25)  # back-off between the last commit's retries
        log.error("gateway writer: the lake refused the last commit; %d requests are lost", self._buffered)

    def _take(self, item: Recorded) -> None:
        try:
            self.blocks.append_rows(item.blocks)
            self.requests.append_rows([item.request])
        except Exception as e:  # a row the lake cannot hold: that request only
            self._on_error()
            log.error("gateway writer: request %s cannot be written (%s); dropped",
                      item.request.get("request_id"), e)
            return
        self._buffered += 1
        if self._oldest is None:
            self._oldest = time.monotonic()

    def _due(self) -> bool:
        if not self._buffered or time.monotonic() < self._retry_at:
            return False
        old = self._oldest is not None and time.monotonic() - self._oldest >= self.flush_age_s
        return old or self._buffered >= self.flush_requests or self._stopping.is_set()

    def _flush(self) -> bool:
        try:
            n_blocks = self.blocks.flush()
            if n_blocks:
                self._on_written("request_blocks", n_blocks)
            n_requests = self.requests.flush()
            if n_requests:
                self._on_written("requests", n_requests)
        except OSError as e:
            self._failures += 1
            self._retry_at = time.monotonic() + min(30.0, 0.25 * 2 ** min(self._failures, 7))
            self._on_error()
            log.error("gateway writer: lake write failed (%s); %d requests kept in memory, retrying", e,
                      self._buffered)
            return False
        self._failures, self._buffered, self._oldest = 0, 0, None
        return True
