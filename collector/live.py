"""Collector for live engine KV events: ZMQ SUB -> bounded queue -> decoder -> ``kv_events`` segments.

Two threads. The **reader** owns the SUB sockets (one per configured source; it connects to
publishers that bind, as vLLM does by default, or binds for publishers that connect) and
only moves multipart messages into a queue bounded in batches *and* bytes. The
**processor** (the caller's thread) hands each message to the per-publisher sequence machine
(collector/live_sequence.py: no sockets; it reaches the replay through this module's DEALER
transport), which decodes what it takes, and commits the rows with their checkpoint.

- Back-pressure, never unbounded growth: when the disk is slow the queue fills, the reader
  blocks in ``put``, the SUB socket's receive high-water mark (``rcvhwm``) fills, and the
  publisher's PUB socket then drops batches. Those drops surface as sequence gaps, which
  the replay socket fills while the engine still buffers them; what it no longer buffers is
  counted and recorded (below). Memory is bounded by ``queue_bytes`` + ``rcvhwm`` messages
  + one replay reply at a time + the rows buffered until the next segment (``flush_rows``).
- Sequences per publisher (replica and topic): a duplicate (``seq`` <= last, with an engine
  time not newer) is dropped; ``seq`` going back with a newer engine time is a publisher
  restart, recorded as a ``cleared`` row for that replica (its cache is gone), stamped just
  after the old process's last batch; a gap asks
  the publisher's ROUTER for ``last+1`` (reply shapes ``[topic, seq, payload]`` and the
  older ``[seq, payload]``, ending at the all-0xFF sequence or an empty payload).
- A gap the replay cannot fill is a ``metric_samples`` row named
  ``kvlens_collector_gap_batches`` (value: batches lost; labels: publisher, from_seq,
  to_seq), so the ledger can say its numbers for that window are incomplete.
- Restart safety: each ``kv_events`` segment carries ``{"publishers": {key: {seq, ts_ns,
  endpoint}}}`` as its checkpoint, written atomically with the rows. A restarted collector
  reads the newest checkpoint of each of its publishers (any ``live-*`` writer's, so a fleet
  that gained or lost a replica keeps the others' places) and asks each publisher's replay
  socket for what follows, so ``kill -9`` loses and duplicates nothing the engine still buffers.
- Malformed frames (wrong frame count, truncated msgpack, wrong types, oversize, a value
  its column cannot hold) are counted by reason, logged with their first bytes, and skipped.
- A sequence number is trusted only from a frame that decodes: an unreadable live frame
  moves nothing (its batch comes back through the replay, which vouches for its number, or
  is recorded as lost). A jump forward is trusted when the publisher's replay (asked from the
  last batch taken, so that a ring that holds anything answers with something) holds a batch
  at or past it: vLLM's publisher fills its ring before it serves a replay, on one thread
  (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher._publisher_thread``). With no replay,
  no answer or an empty ring, a jump is trusted when it is at most ``max_gap_batches``, or
  when the next frame goes on from a refused one. A lower number with a newer engine time is
  a restart only when the replay holds that very batch (a new process's ring), or, with no
  word from a replay, by the time alone. Anything else is a stray
  (``decode_errors{reason="stray_seq"}``): dropped, no gap, no clear, no replay of the ring.
- One batch never stops collection: a batch is decoded all or nothing, a decoder bug costs
  that batch (counted as ``internal``), and rows Arrow refuses are written aside to
  ``LAKE/.quarantine/`` (counted) while the rest of their chunk is written. A lake write
  that fails is retried with back-off, the rows kept in memory (at most
  ``max_buffered_rows``, then the reader stops taking batches: back-pressure), and the
  checkpoint only moves with the rows, so a restart asks the replay for whatever was not
  written. A restart that meets the same bad batch skips it again.
"""

from __future__ import annotations

import collections
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import zmq

from kvlens.collector.capture import capture_line
from kvlens.collector.live_metrics import CollectorMetrics
from kvlens.collector.live_sequence import GAP_METRIC, SequenceTracker
from kvlens.collector.quarantine import spill_rows
from kvlens.collector.vllm_events import DEFAULT_MAX_PAYLOAD_BYTES, EventDecoder, KvColumns
from kvlens.errors import ConfigError
from kvlens.lake import SegmentWriter, writer_checkpoints

__all__ = [  # GAP_METRIC and CollectorMetrics live in live_sequence.py and live_metrics.py
    "GAP_METRIC", "CollectorMetrics", "CollectorOptions", "LiveCollector", "Source", "build_sources",
    "writer_id_for",
]

log = logging.getLogger(__name__)

_NEVER = 1 << 62  # SegmentWriter never flushes by itself: every segment gets a checkpoint
_ARROW_CHUNK_ROWS = 16_384


@dataclass(frozen=True)
class Source:
    """One SUB endpoint: a replica's publisher (connect) or a bound address publishers join."""

    endpoint: str
    replay: str | None = None
    name: str | None = None
    topic: str = ""
    model: str | None = None
    bind: bool = False


@dataclass
class CollectorOptions:
    lake: str | Path
    sources: Sequence[Source]
    scenario: str = "live"
    writer_id: str | None = None
    keep_tokens: bool = False
    flush_age_s: float = 5.0
    flush_rows: int = 500_000
    queue_batches: int = 10_000
    queue_bytes: int = 64 * 2**20
    rcvhwm: int = 10_000
    replay_timeout_s: float = 2.0
    replay_rounds: int = 8
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    record: str | Path | None = None
    max_gap_batches: int = 1 << 20  # a larger jump needs the replay (or the next frame) to confirm it
    max_buffered_rows: int = 2_000_000  # while the lake refuses writes, batches wait in the queue past this


def writer_id_for(sources: Sequence[Source]) -> str:
    """A stable writer id from the replica names (or endpoints): ``live-<names>``."""
    names = sorted(s.name or re.sub(r"^\w+://", "", s.endpoint) for s in sources)
    text = re.sub(r"[^A-Za-z0-9_.]+", "_", "+".join(names)).strip("_")
    if len(text) > 60:
        import hashlib

        text = text[:44] + "_" + hashlib.sha1(text.encode()).hexdigest()[:12]
    return f"live-{text or 'default'}"


_READER_JOIN_S = 10.0  # the reader polls in 100 ms steps: it ends within one after stop()


class _ByteQueue:
    """A FIFO bounded in items and bytes; ``put`` blocks (back-pressure) until there is room.

    One deque under one Condition, not ``queue.SimpleQueue``: the collector's main thread, which runs
    the signal handlers, waits in ``get``, and CPython's ``SimpleQueue.get(timeout=...)`` blocks for
    ever when a handler runs past the timeout (Modules/_queuemodule.c: after an interrupted wait the
    remaining timeout goes negative, and a negative timeout means no timeout); a SIGTERM then hung
    the stop until the watchdog ended the process. ``Condition.wait`` recomputes its timeout after
    a handler and gives up at the deadline (Modules/_threadmodule.c, acquire_timed)."""

    def __init__(self, max_items: int, max_bytes: int) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self._q: collections.deque[tuple[Any, int]] = collections.deque()
        self._cond = threading.Condition()
        self.bytes = self.peak_bytes = self.peak_items = 0

    @property
    def items(self) -> int:
        return len(self._q)

    def put(self, item: Any, nbytes: int, stop: threading.Event) -> bool:
        with self._cond:
            while self.items and (self.items >= self.max_items or self.bytes + nbytes > self.max_bytes):
                if stop.is_set():
                    return False
                self._cond.wait(0.1)
            self._q.append((item, nbytes))
            self.bytes += nbytes
            self.peak_items = max(self.peak_items, self.items)
            self.peak_bytes = max(self.peak_bytes, self.bytes)
            self._cond.notify_all()
        return True

    def get(self, timeout: float) -> Any:
        """The oldest item, waiting up to ``timeout`` seconds for one; None if there is none."""
        with self._cond:
            if not self._q and timeout > 0:
                self._cond.wait(timeout)
            if not self._q:
                return None
            item, nbytes = self._q.popleft()
            self.bytes -= nbytes
            self._cond.notify_all()
        return item


class LiveCollector:
    """Follows the sources and appends ``kv_events`` to the lake until ``stop()`` or a duration."""

    def __init__(self, options: CollectorOptions, *, context: zmq.Context[Any] | None = None,
                 metrics: CollectorMetrics | None = None, clock_ns: Callable[[], int] = time.time_ns) -> None:
        if not options.sources:
            raise ConfigError("no sources: give an endpoint or a kvlens.toml with [[fleet.replicas]]")
        self.opt = options
        # A context of its own, ended when ``run`` ends: the process's shared instance would be ended
        # by the interpreter's exit instead, and zmq_ctx_term blocks there for any socket left open.
        self._own_ctx = context is None
        self.ctx = context or zmq.Context()
        self.metrics = metrics or CollectorMetrics()
        self.clock_ns = clock_ns
        self.writer_id = options.writer_id or writer_id_for(options.sources)
        self.decoder = EventDecoder(keep_tokens=options.keep_tokens,
                                    max_payload_bytes=options.max_payload_bytes)
        self.cols = KvColumns(options.keep_tokens)
        self.queue = _ByteQueue(options.queue_batches, options.queue_bytes)
        self._replay = _ZmqReplay(self.ctx, options.replay_timeout_s)
        self.seq = SequenceTracker(options.sources, metrics=self.metrics, decoder=self.decoder,
                                   cols=self.cols, transport=self._replay,
                                   spill=self._take_rows, chunk_rows=_ARROW_CHUNK_ROWS,
                                   max_gap_batches=options.max_gap_batches,
                                   replay_rounds=options.replay_rounds, clock_ns=clock_ns)
        self.pubs = self.seq.pubs  # the publishers seen, by key (replica and topic)
        self.bound: list[str] = []
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._record: IO[bytes] | None = None
        self._reader_error: BaseException | None = None
        self._bytes_seen = 0

    # -- lifecycle -------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()

    def run(self, duration_s: float | None = None) -> None:
        """Collect until ``stop()`` or ``duration_s``; always ends with a committed checkpoint."""
        deadline = None if duration_s is None else time.monotonic() + duration_s
        o = self.opt
        if self._own_ctx and self.ctx.closed:  # run again after a run that ended its context
            self.ctx = self._replay.ctx = zmq.Context()
        self.seq.resume(self._checkpoint_to_resume())
        reader = threading.Thread(target=self._reader, name="kvlens-zmq-reader", daemon=True)
        with SegmentWriter(o.lake, "kv_events", scenario=o.scenario, writer_id=self.writer_id,
                           flush_rows=_NEVER) as kv, \
                SegmentWriter(o.lake, "metric_samples", scenario=o.scenario,
                              writer_id=f"{self.writer_id}-gaps", flush_rows=_NEVER) as gaps:
            self._kv = kv
            self._gaps = gaps
            self._record = open(o.record, "ab") if o.record else None  # noqa: SIM115
            self.seq.record = self._record_frames if self._record else None
            try:
                reader.start()
                if not self.ready.wait(10):
                    raise RuntimeError(f"ZMQ reader did not start: {self._reader_error}")
                self.seq.replay_checkpointed()
                self._loop(deadline)
            finally:
                self._stop.set()
                reader.join(_READER_JOIN_S)
                try:
                    self._final_flush()
                finally:
                    if self._record:
                        self._record.close()
                    self._end_context(reader)

    def _end_context(self, reader: threading.Thread) -> None:
        """End the context this collector made, once its reader closed its sockets (LINGER 0: nothing
        waits); a reader still running keeps it open, and says so, rather than end it under it."""
        if not self._own_ctx:
            return
        if reader.is_alive():
            log.error("the ZMQ reader did not stop within %.0f s; its context is left open", _READER_JOIN_S)
            return
        self.ctx.destroy(linger=0)

    def _final_flush(self) -> None:
        """The last commit, retried; if the lake still refuses, say what the replay will bring back."""
        for attempt in range(4):
            if self._flush(force=True):
                return
            self._stop.wait(0.5 * 2**attempt)
        rows = len(self.cols) + self._kv.buffered_rows
        raise OSError(f"lake {self.opt.lake} refused the last {rows:,} rows; the checkpoint was not moved, "
                      "so the next run asks the publishers' replay for them: free the disk and restart")

    def _loop(self, deadline: float | None) -> None:
        last_flush = time.monotonic()
        failures = 0
        while not self._stop.is_set() and (deadline is None or time.monotonic() < deadline):
            rows = len(self.cols) + self._kv.buffered_rows
            if rows < self.opt.max_buffered_rows:
                item = self.queue.get(timeout=0.05)
                if item is not None:
                    self._guarded(item)
            else:  # the lake refuses writes: let the queue fill and the publisher's ring keep the rest
                self._stop.wait(0.05)
            self.metrics.queue_batches.set(self.queue.items)
            self.metrics.queue_bytes.set(self.queue.bytes)
            now = time.monotonic()
            rows = len(self.cols) + self._kv.buffered_rows
            wait_s = self.opt.flush_age_s if not failures else min(30.0, 0.5 * 2 ** min(failures, 6))
            if (rows >= self.opt.flush_rows and not failures) or now - last_flush >= wait_s:
                failures = 0 if self._flush() else failures + 1
                last_flush = now
        # drain what the reader already queued, so a clean stop loses nothing it received
        while (item := self.queue.get(timeout=0)) is not None:
            self._guarded(item)

    def _guarded(self, item: tuple[int, list[bytes], int]) -> None:
        try:
            self.seq.handle(*item)
        except Exception as e:  # a bug must not stop collection: count it, log it, go on
            self.metrics.decode_errors.labels(reason="internal").inc()
            log.exception("internal error on a frame starting %r: %s", item[1][:1], e)

    # -- reader thread ---------------------------------------------------------------------

    def _reader(self) -> None:
        socks: list[zmq.Socket[Any]] = []
        try:
            poller = zmq.Poller()
            for s in self.opt.sources:
                sock = self.ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.RCVHWM, self.opt.rcvhwm)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SUBSCRIBE, s.topic.encode())
                if s.bind:
                    sock.bind(s.endpoint)
                    self.bound.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
                else:
                    sock.connect(s.endpoint)
                socks.append(sock)
                poller.register(sock, zmq.POLLIN)
        except zmq.ZMQError as e:
            self._reader_error = e
            log.error("cannot open the event sockets: %s", e)
            for sock in socks:
                sock.close(0)
            return
        self.ready.set()
        index = {sock: i for i, sock in enumerate(socks)}
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(100):
                    frames = sock.recv_multipart()
                    nbytes = sum(len(f) for f in frames)
                    if not self.queue.put((index[sock], frames, self.clock_ns()), nbytes, self._stop):
                        return
        finally:
            for sock in socks:
                sock.close(0)

    # -- writing ---------------------------------------------------------------------------

    def checkpoint(self) -> dict[str, Any]:
        return self.seq.checkpoint()

    def _checkpoint_to_resume(self) -> dict[str, Any]:
        """Per publisher of our sources, the newest checkpoint any collector left for it.

        The writer id names the whole replica set, so a fleet that gained or lost a replica
        writes under a new id; reading every collector writer's last checkpoint (``live-*``)
        and keeping, per publisher, the one with the newest engine time (then sequence: a
        publisher restart resets the sequence, never the clock) keeps every other replica's
        place across the change: nothing is lost or written twice.
        """
        endpoints = {s.endpoint for s in self.opt.sources}
        found: dict[str, dict[str, Any]] = {}
        for writer, cp in writer_checkpoints(self.opt.lake, "kv_events", self.opt.scenario).items():
            if not (writer == self.writer_id or writer.startswith("live-")):
                continue
            for key, st in (cp.get("publishers") or {}).items():
                if st.get("endpoint") not in endpoints:
                    continue
                old = found.get(key)
                if old is None or (int(st["ts_ns"]), int(st["seq"])) > (int(old["ts_ns"]), int(old["seq"])):
                    found[key] = st
        return {"publishers": found}

    def _take_rows(self) -> None:
        """Move the decoded rows to the lake writer; rows Arrow refuses go to the quarantine."""
        try:
            table = self.cols.take_arrow()
        except (pa.ArrowException, OverflowError, TypeError, ValueError) as e:
            table, refused = self.cols.take_arrow_salvaged()
            path = spill_rows(self.opt.lake, self.writer_id, "kv_events", refused, str(e))
            self.metrics.quarantined.inc(len(refused))
            log.error("%d kv_events rows the lake cannot hold (%s) were written to %s", len(refused), e, path)
        self._kv.append_arrow(table)

    def _record_frames(self, frames: list[bytes]) -> None:
        assert self._record is not None
        self._record.write(capture_line(frames))

    def _flush(self, force: bool = False) -> bool:
        """Commit what is buffered with its checkpoint; False when the lake refused (rows kept)."""
        if not self.seq.dirty and not len(self.cols) and not force:
            return True
        try:
            if self.seq.gap_rows:
                self._gaps.append_rows(self.seq.gap_rows)
                self.seq.gap_rows = []
            if self._gaps.buffered_rows:
                # before the kv checkpoint: a crash in between may repeat a gap row, never lose one
                self._gaps.flush()
            if len(self.cols):
                self._take_rows()
            if self.seq.dirty or self._kv.buffered_rows:
                before = self._kv.segments_written
                try:
                    self._kv.flush(self.checkpoint())
                finally:
                    self.metrics.segments.inc(self._kv.segments_written - before)
                    self.metrics.written_bytes.inc(self._kv.bytes_written - self._bytes_seen)
                    self._bytes_seen = self._kv.bytes_written
        except OSError as e:
            self.metrics.write_errors.inc()
            log.error("lake write failed (%s): %d rows kept in memory, retrying", e,
                      self._kv.buffered_rows + len(self.cols))
            return False
        self.seq.dirty = False
        return True


class _ZmqReplay:
    """The sequence machine's replay transport: one DEALER socket per request to a publisher's ROUTER."""

    def __init__(self, ctx: zmq.Context[Any], timeout_s: float) -> None:
        self.ctx, self.timeout_s = ctx, timeout_s

    def ask(self, endpoint: str, start: int, *, warn_timeout: bool = True) -> Iterator[list[bytes]]:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            while sock.poll(int(self.timeout_s * 1000)):
                yield sock.recv_multipart()
            if warn_timeout:
                log.warning("replay from %s timed out after %.1f s", endpoint, self.timeout_s)
        except zmq.ZMQError as e:
            log.warning("replay from %s failed: %s", endpoint, e)
        finally:
            sock.close(0)


def build_sources(*, endpoint: str | None, replay: str | None, topic: str, replica: str | None,
                  model: str | None, bind: bool, config: str | None) -> list[Source]:
    """Sources from the CLI flags, or from ``kvlens.toml``'s fleet when no endpoint is given."""
    from kvlens.config import load_config
    from kvlens.errors import ConfigError

    if endpoint:
        return [Source(endpoint, replay, replica, topic, model, bind)]
    if not config:
        raise ConfigError("no endpoint: give --endpoint tcp://HOST:PORT or --config kvlens.toml")
    fleet = load_config(config).replicas
    if not fleet:
        raise ConfigError(f"{config} lists no [[fleet.replicas]]: add one with an endpoint")
    return [Source(r.endpoint, r.replay_endpoint, r.name, r.topic or topic, r.model or model, r.bind)
            for r in fleet]
