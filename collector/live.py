"""Collector for live engine KV events: ZMQ SUB -> bounded queue -> decoder -> ``kv_events`` segments.

Two threads. The **reader** owns the SUB sockets (one per configured source; it connects to
publishers that bind, as vLLM does by default, or binds for publishers that connect) and
only moves multipart messages into a queue bounded in batches *and* bytes. The
**processor** (the caller's thread) tracks sequences, asks for replays, decodes, writes.

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

import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvlens.collector.quarantine import spill_rows
from kvlens.collector.vllm_events import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    END_SEQ,
    DecodeError,
    EventDecoder,
    KvColumns,
    capture_line,
    split_frames,
    topic_replica,
)
from kvlens.errors import ConfigError
from kvlens.lake import SegmentWriter, writer_checkpoints
from kvlens.schema import EventKind

__all__ = [
    "GAP_METRIC", "CollectorMetrics", "CollectorOptions", "LiveCollector", "Source", "build_sources",
    "writer_id_for",
]

log = logging.getLogger(__name__)

GAP_METRIC = "kvlens_collector_gap_batches"
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


class CollectorMetrics:
    """The collector's own Prometheus metrics, unit-suffixed, in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        p = "kvlens_collector_"
        rl = ["replica"]
        self.batches = Counter(p + "received_batches", "Batches accepted (live and replayed)", rl, registry=r)
        self.block_events = Counter(p + "block_events", "kv_events rows decoded from batches", rl, registry=r)
        self.events = Counter(p + "synthetic_events", "Rows the collector added (publisher restart clears)",
                              ["replica", "kind"], registry=r)
        self.received_bytes = Counter(p + "received_payload_bytes", "Payload bytes accepted", registry=r)
        self.decode_errors = Counter(p + "decode_errors", "Frames, batches or events skipped", ["reason"],
                                     registry=r)
        self.duplicates = Counter(p + "duplicate_batches", "Batches dropped as already written", rl,
                                  registry=r)
        self.gaps = Counter(p + "sequence_gaps", "Sequence gaps detected", rl, registry=r)
        self.replay_requests = Counter(p + "replay_requests", "Replay requests sent", rl, registry=r)
        self.replayed = Counter(p + "replayed_batches", "Batches accepted from replay replies", rl,
                                registry=r)
        self.lost_batches = Counter(p + "unrecoverable_gap_batches", "Batches the replay could not fill", rl,
                                    registry=r)
        self.restarts = Counter(p + "publisher_restarts", "Publisher restarts (sequence reset)", rl,
                                registry=r)
        self.segments = Counter(p + "segments_committed", "kv_events segments committed", registry=r)
        self.write_errors = Counter(p + "write_errors", "Lake writes that failed (retried)", registry=r)
        self.quarantined = Counter(p + "quarantined_rows", "Rows the lake refused, written to .quarantine",
                                   registry=r)
        self.written_bytes = Counter(p + "written_bytes", "Bytes of committed kv_events segments", registry=r)
        self.lag = Gauge(p + "ingest_lag_seconds", "Processing time minus the engine's batch time",
                         registry=r)
        self.queue_batches = Gauge(p + "queue_batches", "Batches waiting between reader and writer",
                                   registry=r)
        self.queue_bytes = Gauge(p + "queue_bytes", "Bytes waiting between reader and writer", registry=r)

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (tests, logs); 0 when it was never set."""
        v = self.registry.get_sample_value(name, labels or None)
        return 0.0 if v is None else v


class _CountingWriter(SegmentWriter):
    """A SegmentWriter that adds up the bytes of the segments it commits."""

    written_bytes = 0

    def _write_segment(self, date: str, part: Any) -> None:
        super()._write_segment(date, part)
        name = f"{self.writer_id}-{self._last_n:020d}.parquet"
        self.written_bytes += (self._target / f"date={date}" / name).stat().st_size


@dataclass
class _Pub:
    key: str
    replica: str
    source: int
    model: str | None = None
    last_seq: int = -1
    last_ts_ns: int = 0
    fresh: bool = True  # first contact in this run and no checkpoint: earlier batches are not "lost"
    stray_seq: int | None = None  # the last sequence number refused as a stray
    bad_seqs: set[int] | None = None  # live frames that did not decode (so a replayed copy counts once)

    def continues_stray(self, seq: int) -> bool:
        """Whether ``seq`` follows the last refused one: the stream goes on from it, so it was real."""
        return self.stray_seq is not None and seq == self.stray_seq + 1

    def remember_bad(self, seq: int) -> bool:
        """Note a frame that did not decode; False when it was noted already (one frame, one count)."""
        if self.bad_seqs is None or len(self.bad_seqs) >= 256:
            self.bad_seqs = set()
        if seq in self.bad_seqs:
            return False
        self.bad_seqs.add(seq)
        return True


class _ByteQueue:
    """A FIFO bounded in items and bytes; ``put`` blocks (back-pressure) until there is room."""

    def __init__(self, max_items: int, max_bytes: int) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self.items = self.bytes = self.peak_bytes = self.peak_items = 0

    def put(self, item: Any, nbytes: int, stop: threading.Event) -> bool:
        with self._cond:
            while self.items and (self.items >= self.max_items or self.bytes + nbytes > self.max_bytes):
                if stop.is_set():
                    return False
                self._cond.wait(0.1)
            self.items += 1
            self.bytes += nbytes
            self.peak_items = max(self.peak_items, self.items)
            self.peak_bytes = max(self.peak_bytes, self.bytes)
        self._q.put((item, nbytes))
        return True

    def get(self, timeout: float) -> Any:
        try:
            item, nbytes = self._q.get(timeout=timeout)
        except queue.Empty:
            return None
        with self._cond:
            self.items -= 1
            self.bytes -= nbytes
            self._cond.notify()
        return item


class LiveCollector:
    """Follows the sources and appends ``kv_events`` to the lake until ``stop()`` or a duration."""

    def __init__(self, options: CollectorOptions, *, context: zmq.Context[Any] | None = None,
                 metrics: CollectorMetrics | None = None, clock_ns: Callable[[], int] = time.time_ns) -> None:
        if not options.sources:
            raise ConfigError("no sources: give an endpoint or a kvlens.toml with [[fleet.replicas]]")
        self.opt = options
        self.ctx = context or zmq.Context.instance()
        self.metrics = metrics or CollectorMetrics()
        self.clock_ns = clock_ns
        self.writer_id = options.writer_id or writer_id_for(options.sources)
        self.decoder = EventDecoder(keep_tokens=options.keep_tokens,
                                    max_payload_bytes=options.max_payload_bytes)
        self.cols = KvColumns(options.keep_tokens)
        self.queue = _ByteQueue(options.queue_batches, options.queue_bytes)
        self.pubs: dict[str, _Pub] = {}
        self.gap_rows: list[dict[str, Any]] = []
        self.bound: list[str] = []
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._dirty = False
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
        self._resume()
        reader = threading.Thread(target=self._reader, name="kvlens-zmq-reader", daemon=True)
        with _CountingWriter(o.lake, "kv_events", scenario=o.scenario, writer_id=self.writer_id,
                           flush_rows=_NEVER) as kv, \
                SegmentWriter(o.lake, "metric_samples", scenario=o.scenario,
                              writer_id=f"{self.writer_id}-gaps", flush_rows=_NEVER) as gaps:
            assert isinstance(kv, _CountingWriter)
            self._kv = kv
            self._gaps = gaps
            self._record = open(o.record, "ab") if o.record else None  # noqa: SIM115
            try:
                reader.start()
                if not self.ready.wait(10):
                    raise RuntimeError(f"ZMQ reader did not start: {self._reader_error}")
                self._replay_checkpointed()
                self._loop(deadline)
            finally:
                self._stop.set()
                reader.join(5)
                try:
                    self._final_flush()
                finally:
                    if self._record:
                        self._record.close()

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
            self._handle(*item)
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

    # -- sequence tracking -----------------------------------------------------------------

    def _resume(self) -> None:
        """Each publisher of our sources resumes from the newest checkpoint any collector left for it.

        The writer id names the whole replica set, so a fleet that gained or lost a replica
        writes under a new id; reading every collector writer's last checkpoint (``live-*``)
        and keeping, per publisher, the one with the newest engine time (then sequence: a
        publisher restart resets the sequence, never the clock) keeps every other replica's
        place across the change: nothing is lost or written twice.
        """
        endpoints = {s.endpoint: i for i, s in enumerate(self.opt.sources)}
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
        for key, st in found.items():
            self.pubs[key] = _Pub(key, st["replica"], endpoints[st["endpoint"]], st.get("model"),
                                  int(st["seq"]), int(st["ts_ns"]), fresh=False)
        if self.pubs:
            log.info("resuming %d publishers from checkpoint", len(self.pubs))

    def _replay_checkpointed(self) -> None:
        for pub in list(self.pubs.values()):
            if self.opt.sources[pub.source].replay:
                self._replay(pub, pub.last_seq + 1, reason="resume")

    def _identify(self, src: int, topic: bytes) -> tuple[str, str, str | None]:
        s = self.opt.sources[src]
        name, model = topic_replica(topic)
        replica = s.name or name or topic.decode("utf-8", "replace") or re.sub(r"^\w+://", "", s.endpoint)
        return f"{replica}|{topic.decode('utf-8', 'replace')}", replica, s.model or model

    def _handle(self, src: int, frames: list[bytes], recv_ns: int) -> None:
        if self._record:
            self._record.write(capture_line(frames))
        try:
            topic, seq, payload = split_frames(frames)
        except DecodeError as e:
            self._bad(e, frames[-1] if frames else b"")
            return
        key, replica, model = self._identify(src, topic)
        pub = self.pubs.get(key)
        try:
            batch = self.decoder.read_batch(payload)
        except DecodeError as e:  # its sequence number is not trusted: nothing moves
            if pub is None or pub.remember_bad(seq):  # a replay may have brought (and counted) it first
                self._bad(e, payload)
            return
        if pub is None:  # only a frame that decodes makes a publisher (garbage topics cost nothing)
            pub = self.pubs[key] = _Pub(key, replica, src, model)
        if seq <= pub.last_seq and not self._restarted(pub, seq, batch[0], payload, recv_ns):
            return
        if seq > pub.last_seq + 1:
            if not self._gap(pub, seq, payload):
                return
            if seq <= pub.last_seq:  # the replay already delivered it
                self.metrics.duplicates.labels(replica=replica).inc()
                return
        self._accept(pub, seq, batch, len(payload), recv_ns)

    def _stray(self, pub: _Pub, seq: int, payload: bytes, why: str) -> None:
        pub.stray_seq = seq
        self.metrics.decode_errors.labels(reason="stray_seq").inc()
        log.warning("publisher %s: dropped a frame with seq %d after %d (%s); starts %r", pub.key, seq,
                    pub.last_seq, why, bytes(payload[:32]))

    def _restarted(self, pub: _Pub, seq: int, ts_ns: int, payload: bytes, recv_ns: int) -> bool:
        """A lower seq with a newer engine time than the last batch is a new publisher process, when
        the replay holds that batch (or has no answer); else a duplicate or a stray (counted)."""
        if ts_ns <= pub.last_ts_ns:
            self.metrics.duplicates.labels(replica=pub.replica).inc()
            return False
        if self._replay_holds(pub, seq, payload) is False:
            self._stray(pub, seq, payload, "the publisher's replay does not hold it: not a restart")
            return False
        pub.stray_seq = None
        log.warning("publisher %s restarted (seq %d after %d): recording a clear", pub.key, seq, pub.last_seq)
        self.metrics.restarts.labels(replica=pub.replica).inc()
        # The old cache vanished between the old process's last batch and this one; the new
        # engine serves requests before it publishes anything, so the clear is stamped at the
        # earliest moment. (A request the old engine served wholly from cache after its last
        # batch published nothing, and reads as a miss: the price of not knowing the moment.)
        self._cleared_row(pub, seq, pub.last_ts_ns + 1 if pub.last_ts_ns else ts_ns, recv_ns)
        pub.last_seq, pub.fresh, pub.bad_seqs = -1, False, None
        return True

    def _cleared_row(self, pub: _Pub, seq: int, ts_ns: int, recv_ns: int) -> None:
        self.cols.add(ts_ns=ts_ns, recv_ns=recv_ns, replica=pub.replica, seq=seq,
                      kind=EventKind.CLEARED.value,
                      namespace=pub.model)
        self.metrics.events.labels(replica=pub.replica, kind=EventKind.CLEARED.value).inc()

    def _gap(self, pub: _Pub, seq: int, payload: bytes) -> bool:
        """Fill a jump to ``seq`` from the replay; False when ``seq`` is a stray (dropped, counted)."""
        start, fresh = pub.last_seq + 1, pub.fresh
        newest = None
        if self.opt.sources[pub.source].replay:
            newest = self._replay(pub, start, reason="gap", upto=seq - 1)
        if newest is not None and newest >= 0:  # the replay answered from its ring: its word is final
            trusted = newest >= seq
        else:  # no replay, no answer, or an empty ring: a plausible jump, or one the stream goes on from
            trusted = seq - start <= self.opt.max_gap_batches or pub.continues_stray(seq)
        if not trusted:
            why = (f"the publisher's replay holds nothing past {newest}" if newest is not None and newest >= 0
                   else f"a jump of {seq - start:,} batches, past max_gap_batches, with no replay to ask")
            self._stray(pub, seq, payload, why)
            return False
        pub.stray_seq = None
        if not fresh:
            self.metrics.gaps.labels(replica=pub.replica).inc()
        if pub.last_seq < seq - 1:
            self._lost(pub, pub.last_seq + 1, seq - 1)
            pub.last_seq = seq - 1
        return True

    def _lost(self, pub: _Pub, first: int, last: int) -> None:
        n = last - first + 1
        if n <= 0:
            return
        if pub.fresh:  # before this collector's time: nothing of ours is missing
            return
        log.warning("publisher %s: batches %d..%d are lost (%d); the replay no longer holds them",
                    pub.key, first, last, n)
        self.metrics.lost_batches.labels(replica=pub.replica).inc(n)
        self.gap_rows.append({"ts_ns": self.clock_ns(), "replica": pub.replica, "name": GAP_METRIC,
                              "labels": [("publisher", pub.key), ("from_seq", str(first)),
                                         ("to_seq", str(last))], "value": float(n)})
        self._dirty = True

    def _accept(self, pub: _Pub, seq: int, batch: tuple[int, list[Any], int | None], nbytes: int,
                recv_ns: int) -> None:
        pub.last_seq, pub.fresh, self._dirty = seq, False, True
        m = self.metrics
        m.batches.labels(replica=pub.replica).inc()
        m.received_bytes.inc(nbytes)
        try:
            info = self.decoder.decode_batch(batch, self.cols, replica=pub.replica, seq=seq, recv_ns=recv_ns,
                                             namespace=pub.model)
        except Exception as e:  # a decoder bug: none of the batch's rows were kept; the sequence moves on
            m.decode_errors.labels(reason="internal").inc()
            log.exception("%s seq %d: skipped a batch the decoder failed on: %s", pub.key, seq, e)
            return
        pub.last_ts_ns = max(pub.last_ts_ns, info.ts_ns)
        m.lag.set(max(0.0, (self.clock_ns() - info.ts_ns) / 1e9))
        if info.rows:
            m.block_events.labels(replica=pub.replica).inc(info.rows)
        for reason in info.bad_events:
            m.decode_errors.labels(reason=reason).inc()
        if info.bad_events:
            log.warning("%s seq %d: skipped %d bad events (%s)", pub.key, seq, len(info.bad_events),
                        ", ".join(sorted(set(info.bad_events))))
        if len(self.cols) >= _ARROW_CHUNK_ROWS:
            self._take_rows()

    def _accept_replayed(self, pub: _Pub, seq: int, payload: bytes) -> None:
        try:
            batch = self.decoder.read_batch(payload)
        except DecodeError as e:  # the publisher's own replay vouches for the number: move past the batch
            pub.last_seq, pub.fresh, self._dirty = seq, False, True
            if pub.remember_bad(seq):
                self._bad(e, payload)
            return
        self._accept(pub, seq, batch, len(payload), self.clock_ns())

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

    def _bad(self, err: DecodeError, data: bytes) -> None:
        self.metrics.decode_errors.labels(reason=err.reason).inc()
        log.warning("skipped a malformed frame (%s): %s; starts %r", err.reason, err, bytes(data[:32]))

    # -- replay ----------------------------------------------------------------------------

    def _replay(self, pub: _Pub, start: int, *, reason: str, upto: int | None = None) -> int | None:
        """Ask the publisher's ROUTER for ``start``..; rounds repeat after a hole mid-stream. Returns
        the newest sequence number the publisher holds (-1: none), or None when it did not answer."""
        endpoint = self.opt.sources[pub.source].replay
        assert endpoint
        newest: int | None = None
        for _ in range(self.opt.replay_rounds):
            self.metrics.replay_requests.labels(replica=pub.replica).inc()
            before = pub.last_seq
            # from the last batch taken, not the next: a ring that still holds it answers with at
            # least that one, so an answer with nothing newer says the jump is not real
            complete, held = self._replay_round(pub, endpoint, max(0, pub.last_seq))
            if held is not None:
                newest = held if newest is None else max(newest, held)
            if complete or pub.last_seq == before or (upto is not None and pub.last_seq >= upto):
                break
        log.info("replay (%s) for %s from %d: now at %d", reason, pub.key, start, pub.last_seq)
        return newest

    def _replay_round(self, pub: _Pub, endpoint: str, start: int) -> tuple[bool, int | None]:
        """One request: (ended cleanly, with no hole after the first reply; the newest seq seen,
        -1 for an answer with none, None for no answer)."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        newest: int | None = None
        try:
            sock.connect(endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            first = True
            timeout_ms = int(self.opt.replay_timeout_s * 1000)
            while sock.poll(timeout_ms):
                frames = sock.recv_multipart()
                newest = -1 if newest is None else newest
                parsed = _replay_reply(frames)
                if parsed is None:
                    return True, newest
                seq, payload = parsed
                newest = max(newest, seq)
                if self._record:
                    self._record.write(capture_line([b"", seq.to_bytes(8, "big"), payload]))
                if seq <= pub.last_seq:
                    continue
                if seq > pub.last_seq + 1:
                    if not first:
                        return False, newest  # dropped on the way (HWM): ask again from last+1
                    self._lost(pub, pub.last_seq + 1, seq - 1)
                first = False
                self.metrics.replayed.labels(replica=pub.replica).inc()
                self._accept_replayed(pub, seq, payload)
            log.warning("replay from %s timed out after %.1f s", endpoint, self.opt.replay_timeout_s)
            return True, newest
        except zmq.ZMQError as e:
            log.warning("replay from %s failed: %s", endpoint, e)
            return True, newest
        finally:
            sock.close(0)

    def _replay_holds(self, pub: _Pub, seq: int, payload: bytes) -> bool | None:
        """Whether the publisher's replay holds exactly this batch at ``seq``; None without an answer
        (or with an empty ring)."""
        endpoint = self.opt.sources[pub.source].replay
        if not endpoint:
            return None
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            sock.send_multipart([b"", seq.to_bytes(8, "big")])
            if not sock.poll(int(self.opt.replay_timeout_s * 1000)):
                return None
            first = _replay_reply(sock.recv_multipart())
            # nothing at or past seq: an empty ring (the publisher keeps none), which tells nothing
            return None if first is None else first == (seq, payload)
        except zmq.ZMQError as e:
            log.warning("replay from %s failed: %s", endpoint, e)
            return None
        finally:
            sock.close(0)

    # -- writing ---------------------------------------------------------------------------

    def checkpoint(self) -> dict[str, Any]:
        return {"publishers": {
            k: {"seq": p.last_seq, "ts_ns": p.last_ts_ns, "replica": p.replica, "model": p.model,
                "endpoint": self.opt.sources[p.source].endpoint}
            for k, p in self.pubs.items() if p.last_seq >= 0}}

    def _flush(self, force: bool = False) -> bool:
        """Commit what is buffered with its checkpoint; False when the lake refused (rows kept)."""
        if not self._dirty and not len(self.cols) and not force:
            return True
        try:
            if self.gap_rows:
                self._gaps.append_rows(self.gap_rows)
                self.gap_rows = []
            if self._gaps.buffered_rows:
                # before the kv checkpoint: a crash in between may repeat a gap row, never lose one
                self._gaps.flush()
            if len(self.cols):
                self._take_rows()
            if self._dirty or self._kv.buffered_rows:
                before = self._kv.segments_written
                try:
                    self._kv.flush(self.checkpoint())
                finally:
                    self.metrics.segments.inc(self._kv.segments_written - before)
                    self.metrics.written_bytes.inc(self._kv.written_bytes - self._bytes_seen)
                    self._bytes_seen = self._kv.written_bytes
        except OSError as e:
            self.metrics.write_errors.inc()
            log.error("lake write failed (%s): %d rows kept in memory, retrying", e,
                      self._kv.buffered_rows + len(self.cols))
            return False
        self._dirty = False
        return True


def _replay_reply(frames: list[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of a replay reply, or None at the end marker (or an unreadable reply)."""
    if frames and frames[0] == b"":
        frames = frames[1:]  # the envelope delimiter a DEALER sees
    if len(frames) == 3:
        frames = frames[1:]  # [topic, seq, payload] (vLLM >= 0.28, SGLang)
    if len(frames) != 2 or len(frames[0]) != 8:
        return None
    seq, payload = frames
    if seq == END_SEQ or not payload:
        return None
    return int.from_bytes(seq, "big"), payload


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
