"""Collector for live engine KV events: the per-publisher sequence machine (no sockets).

It takes the frames the ZMQ loop (collector/live.py) received, in order, and decides per
publisher (replica and topic) what each one is: the next batch (decoded into ``KvColumns``), a
duplicate, a gap to fill from the publisher's replay, a batch the replay no longer holds (a
``kvlens_collector_gap_batches`` row), a publisher restart (a ``cleared`` row) or a stray. The
rules are collector/live.py's docstring; vLLM's side of them: its publisher fills its ring before
it serves a replay, on one thread (``vllm/distributed/kv_events.py``,
``ZmqEventPublisher._publisher_thread``), and a replay request is ``[b"", start.to_bytes(8)]``
answered by ``[topic, seq, payload]`` (``[seq, payload]`` before 0.28) up to an all-0xFF seq.

The replay is reached through a ``ReplayTransport`` (the ZMQ loop's DEALER sockets, or a test's
list of frames), so the machine is tested directly, frame by frame.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvlens.collector.live_metrics import CollectorMetrics
from kvlens.collector.vllm_events import (
    END_SEQ,
    DecodeError,
    EventDecoder,
    KvColumns,
    split_frames,
    topic_replica,
)
from kvlens.schema import EventKind

__all__ = ["GAP_METRIC", "Publisher", "ReplayTransport", "SequenceTracker", "SourceLike", "replay_reply"]

log = logging.getLogger("kvlens.collector.live")

GAP_METRIC = "kvlens_collector_gap_batches"


class SourceLike(Protocol):
    """What the machine reads of a configured source (collector/live.py's ``Source``)."""

    @property
    def endpoint(self) -> str: ...
    @property
    def replay(self) -> str | None: ...
    @property
    def name(self) -> str | None: ...
    @property
    def model(self) -> str | None: ...


class ReplayTransport(Protocol):
    def ask(self, endpoint: str, start: int, *, warn_timeout: bool = True) -> Iterable[list[bytes]]:
        """Send a replay request for ``start``.. to ``endpoint``; yield each reply's frames until the
        publisher stops answering (a failure ends the iteration, logged; a timeout too, logged when
        ``warn_timeout``). Closed (``close()``, when it has one) as soon as the machine has heard enough."""
        ...


@dataclass
class Publisher:
    key: str
    replica: str
    source: int
    model: str | None = None
    last_seq: int = -1
    last_ts_ns: int = 0
    fresh: bool = True  # first contact in this run and no checkpoint: earlier batches are not "lost"
    stray_seq: int | None = None  # the last sequence number refused as a stray
    bad_seqs: set[int] | None = None  # live frames that did not decode (so a replayed copy counts once)

    """One publisher (replica and topic): the last batch taken and what was refused."""

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


_Pub = Publisher


class SequenceTracker:
    """The sequence machine of every publisher behind the configured sources.

    ``cols`` receives the decoded rows; ``spill`` is called when it holds ``chunk_rows`` (the
    writer moves them on); ``gap_rows`` collects the lost-batch rows; ``dirty`` says something
    moved since the last commit (the caller resets it); ``record``, when set, is handed every
    frame received, live or replayed (``kvlens collect vllm --record``).
    """

    def __init__(self, sources: Sequence[SourceLike], *, metrics: CollectorMetrics, decoder: EventDecoder,
                 cols: KvColumns, transport: ReplayTransport, spill: Callable[[], None],
                 chunk_rows: int = 16_384, max_gap_batches: int = 1 << 20, replay_rounds: int = 8,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.sources, self.metrics, self.decoder, self.cols = sources, metrics, decoder, cols
        self.transport, self.spill, self.chunk_rows = transport, spill, chunk_rows
        self.max_gap_batches, self.replay_rounds, self.clock_ns = max_gap_batches, replay_rounds, clock_ns
        self.pubs: dict[str, Publisher] = {}
        self.gap_rows: list[dict[str, Any]] = []
        self.dirty = False
        self.record: Callable[[list[bytes]], None] | None = None

    def resume(self, cp: dict[str, Any]) -> None:
        """Take up the publishers of a checkpoint (``checkpoint()``'s form) whose endpoint is configured."""
        endpoints = {s.endpoint: i for i, s in enumerate(self.sources)}
        for key, st in (cp.get("publishers") or {}).items():
            src = endpoints.get(st.get("endpoint"))
            if src is None:
                continue
            self.pubs[key] = Publisher(key, st["replica"], src, st.get("model"), int(st["seq"]),
                                       int(st["ts_ns"]), fresh=False)
        if self.pubs:
            log.info("resuming %d publishers from checkpoint", len(self.pubs))

    def replay_checkpointed(self) -> None:
        """Ask each resumed publisher's replay for what follows its checkpoint."""
        for pub in list(self.pubs.values()):
            if self.sources[pub.source].replay:
                self._replay(pub, pub.last_seq + 1, reason="resume")

    def _identify(self, src: int, topic: bytes) -> tuple[str, str, str | None]:
        s = self.sources[src]
        name, model = topic_replica(topic)
        replica = s.name or name or topic.decode("utf-8", "replace") or re.sub(r"^\w+://", "", s.endpoint)
        return f"{replica}|{topic.decode('utf-8', 'replace')}", replica, s.model or model

    def handle(self, src: int, frames: list[bytes], recv_ns: int) -> None:
        """One multipart message from source ``src``, received at ``recv_ns``."""
        if self.record:
            self.record(frames)
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
            pub = self.pubs[key] = Publisher(key, replica, src, model)
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
        if self.sources[pub.source].replay:
            newest = self._replay(pub, start, reason="gap", upto=seq - 1)
        if newest is not None and newest >= 0:  # the replay answered from its ring: its word is final
            trusted = newest >= seq
        else:  # no replay, no answer, or an empty ring: a plausible jump, or one the stream goes on from
            trusted = seq - start <= self.max_gap_batches or pub.continues_stray(seq)
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
        self.dirty = True

    def _accept(self, pub: _Pub, seq: int, batch: tuple[int, list[Any], int | None], nbytes: int,
                recv_ns: int) -> None:
        pub.last_seq, pub.fresh, self.dirty = seq, False, True
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
        if len(self.cols) >= self.chunk_rows:
            self.spill()

    def _accept_replayed(self, pub: _Pub, seq: int, payload: bytes) -> None:
        try:
            batch = self.decoder.read_batch(payload)
        except DecodeError as e:  # the publisher's own replay vouches for the number: move past the batch
            pub.last_seq, pub.fresh, self.dirty = seq, False, True
            if pub.remember_bad(seq):
                self._bad(e, payload)
            return
        self._accept(pub, seq, batch, len(payload), self.clock_ns())

    def _bad(self, err: DecodeError, data: bytes) -> None:
        self.metrics.decode_errors.labels(reason=err.reason).inc()
        log.warning("skipped a malformed frame (%s): %s; starts %r", err.reason, err, bytes(data[:32]))

    def _replay(self, pub: _Pub, start: int, *, reason: str, upto: int | None = None) -> int | None:
        """Ask the publisher's ROUTER for ``start``..; rounds repeat after a hole mid-stream. Returns
        the newest sequence number the publisher holds (-1: none), or None when it did not answer."""
        endpoint = self.sources[pub.source].replay
        assert endpoint
        newest: int | None = None
        for _ in range(self.replay_rounds):
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
        newest: int | None = None
        first = True
        replies = self.transport.ask(endpoint, start)
        try:
            for frames in replies:
                newest = -1 if newest is None else newest
                parsed = replay_reply(frames)
                if parsed is None:
                    return True, newest
                seq, payload = parsed
                newest = max(newest, seq)
                if self.record:
                    self.record([b"", seq.to_bytes(8, "big"), payload])
                if seq <= pub.last_seq:
                    continue
                if seq > pub.last_seq + 1:
                    if not first:
                        return False, newest  # dropped on the way (HWM): ask again from last+1
                    self._lost(pub, pub.last_seq + 1, seq - 1)
                first = False
                self.metrics.replayed.labels(replica=pub.replica).inc()
                self._accept_replayed(pub, seq, payload)
            return True, newest  # the publisher stopped answering (timed out) or could not be reached
        finally:
            close = getattr(replies, "close", None)
            if close is not None:
                close()

    def _replay_holds(self, pub: _Pub, seq: int, payload: bytes) -> bool | None:
        """Whether the publisher's replay holds exactly this batch at ``seq``; None without an answer
        (or with an empty ring)."""
        endpoint = self.sources[pub.source].replay
        if not endpoint:
            return None
        replies = self.transport.ask(endpoint, seq, warn_timeout=False)
        try:
            frames = next(iter(replies), None)
        finally:
            close = getattr(replies, "close", None)
            if close is not None:
                close()
        if frames is None:
            return None
        first = replay_reply(frames)
        # nothing at or past seq: an empty ring (the publisher keeps none), which tells nothing
        return None if first is None else first == (seq, payload)

    def checkpoint(self) -> dict[str, Any]:
        """Where each publisher stands: the checkpoint a segment carries."""
        return {"publishers": {
            k: {"seq": p.last_seq, "ts_ns": p.last_ts_ns, "replica": p.replica, "model": p.model,
                "endpoint": self.sources[p.source].endpoint}
            for k, p in self.pubs.items() if p.last_seq >= 0}}


def replay_reply(frames: list[bytes]) -> tuple[int, bytes] | None:
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
