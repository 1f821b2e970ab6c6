"""Collector for engine metrics: a Prometheus text exposition, scraped over HTTP -> ``metric_samples``.

Each scrape fetches ``/metrics`` (urllib, with a timeout and a body-size limit), parses it with
prometheus-client's own parser and keeps every sample of the families on an allow-list of
name prefixes (``DEFAULT_FAMILY_PREFIXES``):

- vLLM (FORMATS.md 3): ``vllm:prefix_cache_*`` and ``vllm:external_prefix_cache_*`` (token
  counters), the deprecated ``vllm:gpu_prefix_cache_*``, ``vllm:kv_cache_usage_perc`` and the
  older ``vllm:gpu_cache_usage_perc``, ``vllm:num_requests_running`` / ``_waiting*``,
  ``vllm:num_preemptions``, ``vllm:prompt_tokens*`` (incl. ``_cached`` and ``_by_source``) and
  the TTFT histogram ``vllm:time_to_first_token_seconds``;
- SGLang (FORMATS.md 2.1): ``sglang:cache_hit_rate``, ``sglang:cached_tokens``,
  ``sglang:prompt_tokens``, ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
  ``sglang:num_retracted_reqs``, ``sglang:token_usage``, ``sglang:time_to_first_token_seconds``;
- LMCache (FORMATS.md 2.5): every ``lmcache:*`` family and the MP server's ``lmcache_mp*``.

Rows keep the sample name as exposed (``_total``, ``_created``, ``_bucket``, ``_sum``,
``_count``), its labels (sorted by name) and value, with ``ts_ns`` = the scrape time. A sample
whose value is NaN or infinite (the text format allows them: a summary with no observations)
is skipped and counted (``ScrapeStats.skipped_samples``): ``metric_samples.value`` holds finite
numbers only (kvlens.limits), so a counter sum never turns NaN. Counter
resets are not touched here: raw values are stored and analyzers.reconcile handles resets.

``FleetScraper`` follows every replica of a ``kvlens.toml`` that has a ``metrics_url``, one
``Scraper`` (and one writer, ``scrape-<replica>``) per replica, each on its own thread of one
process; a slow or dead endpoint delays only its own replica.

A failed scrape (connection refused, timeout, an HTTP error status, a body that does not
parse) is counted and logged, never raised; the loop keeps its interval. Memory is bounded
by the writer's ``flush_rows`` and the body-size limit.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.client import HTTPException
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvlens.lake import SegmentWriter

__all__ = [
    "DEFAULT_FAMILY_PREFIXES", "FleetScraper", "ScrapeError", "ScrapeStats", "Scraper", "fetch",
    "fleet_targets", "parse_exposition",
]

log = logging.getLogger(__name__)

DEFAULT_FAMILY_PREFIXES: tuple[str, ...] = (
    "vllm:prefix_cache_", "vllm:external_prefix_cache_", "vllm:gpu_prefix_cache_",
    "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_preemptions",
    "vllm:prompt_tokens", "vllm:time_to_first_token_seconds",
    "sglang:cache_hit_rate", "sglang:cached_tokens", "sglang:prompt_tokens", "sglang:num_running_reqs",
    "sglang:num_queue_reqs", "sglang:num_retracted_reqs", "sglang:token_usage",
    "sglang:time_to_first_token_seconds",
    "lmcache:", "lmcache_mp",
)
MAX_BODY_BYTES = 16 * 1024 * 1024
_ACCEPT = "text/plain;version=0.0.4;q=1.0, */*;q=0.1"


class ScrapeError(Exception):
    """One scrape failed: why, in words (the loop counts it and carries on)."""


def fetch(url: str, *, timeout_s: float, max_bytes: int = MAX_BODY_BYTES) -> str:
    """The exposition text at ``url``; a ScrapeError for anything but a readable 200 body."""
    req = urllib.request.Request(url, headers={"Accept": _ACCEPT, "User-Agent": "kvlens-scrape"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body: bytes = resp.read(max_bytes + 1)
    except (OSError, HTTPException, ValueError) as e:  # URLError/HTTPError/timeouts are OSErrors
        raise ScrapeError(f"fetch failed: {e}") from None
    if len(body) > max_bytes:
        raise ScrapeError(f"body larger than {max_bytes} bytes")
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ScrapeError(f"body is not UTF-8: {e}") from None


def parse_exposition(text: str, prefixes: Sequence[str] = DEFAULT_FAMILY_PREFIXES, *,
                     skipped: list[str] | None = None) -> list[tuple[str, list[tuple[str, str]], float]]:
    """(sample name as exposed, sorted labels, value) of every sample of an allowed family with a
    finite value; the names of samples skipped for a NaN or infinite value go to ``skipped``."""
    keep = tuple(prefixes)
    out: list[tuple[str, list[tuple[str, str]], float]] = []
    try:
        for family in text_string_to_metric_families(text):
            if not family.name.startswith(keep):
                continue
            for s in family.samples:
                value = float(s.value)
                if math.isfinite(value):
                    out.append((s.name, sorted(s.labels.items()), value))
                elif skipped is not None:
                    skipped.append(s.name)
    except Exception as e:  # the third-party parser raises several types on bad text
        raise ScrapeError(f"exposition does not parse: {type(e).__name__}: {e}") from None
    return out


@dataclass
class ScrapeStats:
    ok: int = 0
    failed: int = 0
    samples: int = 0
    skipped_samples: int = 0  # NaN or infinite values
    last_error: str | None = None
    errors: list[str] = field(default_factory=list)  # the first few, for the operator


class Scraper:
    """Scrapes one replica's ``/metrics`` every ``interval_s`` into ``metric_samples``.

    ``fetch_text`` and ``clock_ns`` are injectable for tests; ``stop()`` may be called from
    another thread or a signal handler. ``run`` commits the buffered rows when it returns.
    """

    def __init__(self, *, url: str, replica: str, lake: str, interval_s: float = 15.0,
                 timeout_s: float = 5.0, scenario: str = "live", flush_s: float = 60.0,
                 flush_rows: int = 200_000, prefixes: Sequence[str] = DEFAULT_FAMILY_PREFIXES,
                 fetch_text: Callable[[str, float], str] | None = None,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.url, self.replica, self.interval_s, self.timeout_s = url, replica, interval_s, timeout_s
        self.prefixes = tuple(prefixes)
        self.fetch_text = fetch_text or (lambda u, t: fetch(u, timeout_s=t))
        self.clock_ns = clock_ns
        self.stats = ScrapeStats()
        self.writer = SegmentWriter(lake, "metric_samples", scenario=scenario, writer_id=f"scrape-{replica}",
                                    flush_rows=flush_rows, flush_age_s=flush_s)
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def scrape_once(self) -> int:
        """One scrape; the samples it buffered (0 when it failed, which is counted)."""
        skipped: list[str] = []
        try:
            text = self.fetch_text(self.url, self.timeout_s)
            ts_ns = self.clock_ns()
            samples = parse_exposition(text, self.prefixes, skipped=skipped)
        except ScrapeError as e:
            self._failed(str(e))
            return 0
        if skipped:
            self.stats.skipped_samples += len(skipped)
            log.info("scrape of %s: skipped %d samples with a NaN or infinite value (first: %s)", self.url,
                     len(skipped), skipped[0])
        self.writer.append_columns(_columns(samples, ts_ns, self.replica))
        self.stats.ok += 1
        self.stats.samples += len(samples)
        return len(samples)

    def _failed(self, why: str) -> None:
        self.stats.failed += 1
        self.stats.last_error = why
        if len(self.stats.errors) < 5:
            self.stats.errors.append(why)
        log.warning("scrape of %s (replica %s) failed (%d so far): %s", self.url, self.replica,
                    self.stats.failed, why)

    def run(self, duration_s: float | None = None) -> ScrapeStats:
        """Scrape until ``stop()`` or ``duration_s``; always commits what was buffered."""
        deadline = None if duration_s is None else time.monotonic() + duration_s
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                self.scrape_once()
                self.writer.maybe_flush()
                wait = self.interval_s - (time.monotonic() - started)
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    wait = min(wait, left)
                if wait > 0 and self._stop.wait(wait):
                    break
        finally:
            self.writer.commit()
        return self.stats


def fleet_targets(config: str) -> list[tuple[str, str]]:
    """(replica, metrics_url) of every replica of ``config`` with a ``metrics_url`` (checked)."""
    from kvlens.config import check_http_url, load_config
    from kvlens.errors import ConfigError

    targets = []
    for i, r in enumerate(load_config(config).replicas):
        if not r.metrics_url:
            continue
        if not r.name:
            raise ConfigError(f"{config} fleet.replicas[{i}]: a replica with a metrics_url needs a name "
                              "(its samples are recorded under it)")
        targets.append((r.name, check_http_url(r.metrics_url, f"{config} fleet.replicas[{i}]: metrics_url")))
    if not targets:
        raise ConfigError(f"{config}: no [[fleet.replicas]] has a metrics_url: add one, "
                          "e.g. metrics_url = \"http://10.0.0.5:8000/metrics\"")
    return targets


class FleetScraper:
    """One ``Scraper`` per (replica, url), each on its own thread; ``run`` returns when all stop."""

    def __init__(self, targets: Sequence[tuple[str, str]], **options: Any) -> None:
        self.scrapers = [Scraper(url=url, replica=replica, **options) for replica, url in targets]

    def stop(self) -> None:
        for s in self.scrapers:
            s.stop()

    def run(self, duration_s: float | None = None) -> list[ScrapeStats]:
        threads = [threading.Thread(target=s.run, args=(duration_s,), name=f"kvlens-scrape-{s.replica}",
                                    daemon=True) for s in self.scrapers]
        for t in threads:
            t.start()
        for t in threads:  # each ends at stop() or the duration; its run commits its rows
            t.join()
        return [s.stats for s in self.scrapers]


def _columns(samples: list[tuple[str, list[tuple[str, str]], float]], ts_ns: int,
             replica: str) -> dict[str, Any]:
    n = len(samples)
    return {
        "ts_ns": [ts_ns] * n,
        "replica": [replica] * n,
        "name": [s[0] for s in samples],
        "labels": [s[1] for s in samples],
        "value": [s[2] for s in samples],
    }
