"""Collector writer behind the OTLP receiver: a bounded queue of ``requests`` rows -> lake segments.

One thread takes row batches from the queue and appends them to a ``SegmentWriter`` that commits
at least every ``flush_age_s``. It survives any single batch and any lake failure:

- rows the lake cannot hold (a value past its column that got past the decoder) are found row
  by row, written aside to ``LAKE/.quarantine/`` (counted, logged) and the rest of the batch
  is written;
- a write the lake refuses (disk full, gone) is retried with back-off; its rows stay buffered
  (SegmentWriter.flush keeps them). Past ``max_buffered_rows`` the thread stops taking batches,
  the queue fills and the receiver answers 503, which OTLP exporters retry;
- a bug on one batch is logged and counted; the thread goes on.

``stop()`` drains the queue and commits, retrying; rows the lake still refuses are spilled to
the quarantine, so nothing accepted is lost without a file and a log line saying where.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from kvlens.collector.quarantine import spill_rows
from kvlens.lake import SegmentWriter

__all__ = ["RowWriter"]

log = logging.getLogger(__name__)

_APPEND_ROWS = 8192
_DATA_ERRORS = (pa.ArrowException, OverflowError, TypeError, ValueError)


class RowWriter:
    """Appends queued ``requests`` rows to the lake from its own thread (``start``/``put``/``stop``).

    ``metrics`` has the receiver's counters ``rows_written``, ``queue_batches``, ``write_errors``,
    ``quarantined`` and ``internal_errors``.
    """

    def __init__(self, lake: str | Path, *, scenario: str, writer_id: str, flush_age_s: float,
                 queue_batches: int, max_buffered_rows: int, metrics: Any) -> None:
        self.lake, self.writer_id, self.metrics = lake, writer_id, metrics
        self.flush_age_s, self.max_buffered_rows = flush_age_s, max_buffered_rows
        self.queue: queue.Queue[list[dict[str, Any]]] = queue.Queue(queue_batches)
        self.writer = SegmentWriter(lake, "requests", scenario=scenario, writer_id=writer_id,
                                    flush_rows=1 << 62, flush_age_s=flush_age_s)
        self.error: BaseException | None = None  # set when stop() could neither commit nor spill
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvlens-otlp-writer")
        self._counted = 0
        self._failures = 0
        self._next_try = 0.0

    def start(self) -> None:
        self._thread.start()

    def put(self, rows: list[dict[str, Any]], timeout_s: float) -> bool:
        """Queue one batch; False when the queue stayed full for ``timeout_s``."""
        try:
            self.queue.put(rows, timeout=timeout_s)
        except queue.Full:
            return False
        self.metrics.queue_batches.set(self.queue.qsize())
        return True

    def stop(self, timeout_s: float) -> None:
        self._stopping.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("OTLP writer still busy after %.0f s; rows not yet committed stay in memory", timeout_s)

    # -- the thread -------------------------------------------------------------------------------

    def _loop(self) -> None:
        pending: list[dict[str, Any]] = []
        tick = min(0.2, self.flush_age_s)
        while True:
            stopping = self._stopping.is_set()
            item = None
            try:
                if self.writer.buffered_rows + len(pending) < self.max_buffered_rows or stopping:
                    try:
                        item = self.queue.get(timeout=0 if stopping else tick)
                    except queue.Empty:
                        item = None
                else:  # the lake refuses writes and the buffer is full: let the queue fill (503s)
                    self._stopping.wait(tick)
                if item:
                    pending.extend(item)
                if pending and (item is None or len(pending) >= _APPEND_ROWS or self.queue.empty()):
                    rows, pending = pending, []
                    self._append(rows)
                if stopping and item is None:
                    break
                self._flush(force=False)
            except Exception as e:  # never die: count, log, and go on after a pause
                self.metrics.internal_errors.inc()
                log.exception("OTLP writer: %s", e)
                self._stopping.wait(0.1)
        try:
            self._append(pending)
        finally:
            self._final_commit()

    def _append(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        try:
            self.writer.append_rows(rows)  # an age flush may run (and fail) inside: rows stay buffered
        except OSError as e:
            self._write_failed(e)
        except _DATA_ERRORS as e:
            self._salvage(rows, e)
        except Exception as e:  # a bug: the batch is lost, the writer is not
            self.metrics.internal_errors.inc()
            log.exception("OTLP writer: %d rows failed to append (%s)", len(rows), e)

    def _salvage(self, rows: list[dict[str, Any]], err: Exception) -> None:
        """Row by row: the rows the lake takes are appended, the others quarantined."""
        schema = self.writer.schema
        good, refused = [], []
        for row in rows:
            try:
                pa.Table.from_pylist([row], schema=schema)
            except _DATA_ERRORS:
                refused.append(row)
            else:
                good.append(row)
        if good:
            self._append(good)
        if refused:
            path = spill_rows(self.lake, self.writer_id, "requests", refused, str(err))
            self.metrics.quarantined.inc(len(refused))
            log.error("OTLP writer: %d rows the lake cannot hold (%s) were written to %s", len(refused), err,
                      path)

    def _flush(self, *, force: bool) -> bool:
        now = time.monotonic()
        if not force and self._failures and now < self._next_try:
            return False
        try:
            if force:
                self.writer.commit()
            else:
                self.writer.maybe_flush()
        except OSError as e:
            self._write_failed(e)
            return False
        finally:
            self._count_written()
        self._failures = 0
        return True

    def _write_failed(self, err: OSError) -> None:
        self._failures += 1
        self._next_try = time.monotonic() + min(30.0, 0.25 * 2 ** min(self._failures, 7))
        self.metrics.write_errors.inc()
        log.error("OTLP writer: lake write failed (%s); %d rows kept in memory, retrying", err,
                  self.writer.buffered_rows)
        self._count_written()

    def _count_written(self) -> None:
        self.metrics.rows_written.inc(self.writer.rows_written - self._counted)
        self._counted = self.writer.rows_written
        self.metrics.queue_batches.set(self.queue.qsize())

    def _final_commit(self) -> None:
        for attempt in range(4):
            self._failures = 0
            if self._flush(force=True):
                return
            time.sleep(0.25 * 2**attempt)  # back-off between retries of the last commit
        rows = self.writer.take_buffer().to_pylist()
        try:
            path = spill_rows(self.lake, self.writer_id, "requests", rows, "the lake refused the last commit")
        except OSError as e:
            self.error = e
            log.error("OTLP writer: %d accepted rows could be neither committed nor spilled: %s",
                      len(rows), e)
            return
        self.metrics.quarantined.inc(len(rows))
        log.error("OTLP writer: the lake refused the last commit; %d rows were written to %s",
                  len(rows), path)
