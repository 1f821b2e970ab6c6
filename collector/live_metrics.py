"""Collector for live engine KV events: its own Prometheus metrics (collector/live.py, live_sequence.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = ["CollectorMetrics"]


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
