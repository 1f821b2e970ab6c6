"""Dashboards: the latest ledger as Prometheus gauges, for an existing Grafana (``kvlens export``).

A custom collector keeps a snapshot of the analysis DB and reloads it at scrape time when the
file changed (``kvlens analyze`` renames a new file into place). A reload that fails keeps the
previous snapshot and sets ``kvlens_export_up`` to 0. Gauges:

    kvlens_prompt_tokens{outcome,replica,scenario}   tokens of needed full blocks, per outcome
    kvlens_prompt_bytes{outcome,replica,scenario}    their KV bytes
    kvlens_tail_partial_tokens{replica,scenario}     partial last blocks (recomputed by definition)
    kvlens_hit_ratio{replica,scenario,unit}          unit=tokens: hit tokens / prompt tokens; unit=bytes:
                                                     hit bytes / (prompt tokens x KV bytes per token);
                                                     absent where the replica published no KV events
                                                     (its residency, so its ratio, is unknown)
    kvlens_export_up, kvlens_export_loaded_timestamp_seconds

These totals cover the scenario's whole history; dashboards/export_windows.py adds the last
analysis window's series (``kvlens_ledger_window_*``, tails, top prefixes, the crossover).
Tokens are measured for recorded scenarios and modelled for simulated ones
(``kvlens_scenario_info``); bytes are modelled from the model's KV geometry.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvlens.dashboards.export_windows import (
    DEFAULT_TOP_PREFIXES,
    WindowSnapshot,
    load_windows,
    window_families,
)
from kvlens.dashboards.queries import OBSERVED_SQL
from kvlens.dashboards.read import open_db
from kvlens.schema import HIT_OUTCOMES_SQL

__all__ = ["LEDGER_SQL", "RATIO_SQL", "LedgerCollector", "Snapshot", "load_snapshot", "serve"]

log = logging.getLogger(__name__)

LEDGER_SQL = """
SELECT scenario, coalesce(replica, '') AS replica, CAST(outcome AS VARCHAR) AS outcome,
       sum(tokens) AS tokens, sum(bytes) AS bytes
FROM miss_ledger GROUP BY ALL ORDER BY 1, 2, 3
"""

RATIO_SQL = f"""
WITH h AS (
    SELECT scenario, coalesce(replica, '') AS replica,
           coalesce(sum(tokens) FILTER (WHERE outcome IN {HIT_OUTCOMES_SQL}), 0)
               AS hit_tokens,
           coalesce(sum(bytes) FILTER (WHERE outcome IN {HIT_OUTCOMES_SQL}), 0)
               AS hit_bytes
    FROM miss_ledger GROUP BY ALL
), p AS (
    SELECT scenario, coalesce(replica, '') AS replica, sum(prompt_tokens) AS prompt_tokens,
           sum(tail_partial_tokens) AS tail_partial_tokens,
           {OBSERVED_SQL} AS observed
    FROM request_ledger GROUP BY ALL
)
SELECT p.scenario, p.replica,
       CASE WHEN p.observed THEN coalesce(h.hit_tokens, 0) / nullif(p.prompt_tokens, 0)
       END AS token_hit_ratio,
       CASE WHEN p.observed THEN coalesce(h.hit_bytes, 0) / nullif(p.prompt_tokens * s.kv_bytes_per_token, 0)
       END AS byte_hit_ratio,
       p.tail_partial_tokens
FROM p LEFT JOIN h USING (scenario, replica) LEFT JOIN scenarios s USING (scenario)
ORDER BY 1, 2
"""


@dataclass(frozen=True)
class Snapshot:
    ledger: list[tuple[Any, ...]]  # scenario, replica, outcome, tokens, bytes
    ratios: list[tuple[Any, ...]]  # scenario, replica, token ratio, byte ratio, tail partial tokens
    loaded_s: float
    windows: WindowSnapshot | None = None  # the last analysis window's series


def load_snapshot(db: str | Path, *, top_prefixes: int = DEFAULT_TOP_PREFIXES) -> Snapshot:
    """Read the ledger, hit ratios and windowed series from the analysis DB (read-only)."""
    con = open_db(db)
    try:
        return Snapshot(con.execute(LEDGER_SQL).fetchall(), con.execute(RATIO_SQL).fetchall(), time.time(),
                        load_windows(con, top_prefixes=top_prefixes))
    finally:
        con.close()


def _file_key(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class LedgerCollector(Collector):
    """Serves the snapshot; reloads it when the DB file's inode, size or mtime changed."""

    def __init__(self, db: str | Path, *, top_prefixes: int = DEFAULT_TOP_PREFIXES) -> None:
        self.db = Path(db)
        self.top_prefixes = top_prefixes
        self._lock = threading.Lock()
        self._key = _file_key(self.db)
        # fails loudly at start: a bad path is one error line
        self._snapshot = load_snapshot(self.db, top_prefixes=top_prefixes)
        self._up = True

    def _refresh(self) -> None:
        key = _file_key(self.db)
        if key == self._key and self._up:
            return
        try:
            self._snapshot = load_snapshot(self.db, top_prefixes=self.top_prefixes)
            self._key, self._up = key, True
        except Exception as e:  # a file being replaced, or gone: keep serving the last good snapshot
            log.warning("reloading %s failed, serving the previous snapshot: %s", self.db, e)
            self._up = False

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            self._refresh()
            snap, up = self._snapshot, self._up
        tokens = GaugeMetricFamily("kvlens_prompt_tokens", "Tokens of needed full blocks per ledger outcome",
                                   labels=["outcome", "replica", "scenario"])
        nbytes = GaugeMetricFamily("kvlens_prompt_bytes", "KV bytes of needed full blocks per ledger outcome",
                                   labels=["outcome", "replica", "scenario"])
        for scenario, replica, outcome, t, b in snap.ledger:
            tokens.add_metric([outcome, replica, scenario], float(t))
            nbytes.add_metric([outcome, replica, scenario], float(b))
        ratio = GaugeMetricFamily("kvlens_hit_ratio", "Hit share of prompt tokens (unit=tokens) or of "
                                  "prompt KV bytes (unit=bytes)", labels=["replica", "scenario", "unit"])
        tail = GaugeMetricFamily("kvlens_tail_partial_tokens", "Tokens of partial last blocks (recomputed)",
                                 labels=["replica", "scenario"])
        for scenario, replica, by_tokens, by_bytes, tail_tokens in snap.ratios:
            if by_tokens is not None:
                ratio.add_metric([replica, scenario, "tokens"], float(by_tokens))
            if by_bytes is not None:
                ratio.add_metric([replica, scenario, "bytes"], float(by_bytes))
            tail.add_metric([replica, scenario], float(tail_tokens or 0))
        yield from (tokens, nbytes, ratio, tail)
        if snap.windows is not None:
            yield from window_families(snap.windows)
        yield GaugeMetricFamily("kvlens_export_up", "1 when the last reload of the DB succeeded",
                                value=float(up))
        yield GaugeMetricFamily("kvlens_export_loaded_timestamp_seconds", "When the served snapshot was read",
                                value=snap.loaded_s)


def serve(db: str | Path, *, port: int, host: str = "127.0.0.1",
          top_prefixes: int = DEFAULT_TOP_PREFIXES) -> tuple[Any, threading.Thread, int]:
    """Start the exposition server in a thread: (server, thread, bound port; port 0 picks one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LedgerCollector(db, top_prefixes=top_prefixes))
    server, thread = start_http_server(port, addr=host, registry=registry)
    return server, thread, int(server.server_address[1])
