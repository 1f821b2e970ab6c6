"""Collectors' front doors for ``kvlens collect``: a live source, until its duration or a stop -> the lake.

Each checks its addresses first (one-line ConfigErrors), says where it collects through
``announce``, runs its loop inside ``until``'s scope (the CLI's turns SIGTERM/SIGINT into a
stop; kvlens/supervise.py), and returns what it took.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvlens.config import check_http_url, check_zmq_endpoint
from kvlens.errors import ConfigError
from kvlens.supervise import StopScope, check_port_free, stop_scope

if TYPE_CHECKING:
    from kvlens.collector.scrape import ScrapeStats

__all__ = ["OtlpCollectResult", "ReplicaEvents", "collect_otlp", "collect_scrape", "collect_scrape_fleet",
           "collect_scrapes", "collect_vllm"]

Announce = Callable[[str], object]


def _quiet(_line: str) -> None:
    pass


@dataclass(frozen=True)
class ReplicaEvents:
    """What ``collect_vllm`` received from one replica."""

    replica: str
    batches: int
    block_events: int


@dataclass(frozen=True)
class OtlpCollectResult:
    requests: int
    llm_request_spans: int
    other_spans: int
    written_rows: int


def collect_vllm(lake: str | Path, *, endpoint: str | None = None, replay: str | None = None,
                 topic: str = "", replica: str | None = None, model: str | None = None, bind: bool = False,
                 config: str | None = None, keep_tokens: bool = False, record: str | None = None,
                 flush_s: float = 5.0, scenario: str = "live", duration_s: float | None = None,
                 metrics_port: int | None = None, metrics_addr: str = "127.0.0.1",
                 until: StopScope | None = None, announce: Announce = _quiet) -> tuple[ReplicaEvents, ...]:
    """KV-cache events from ``endpoint`` (or ``config``'s fleet) into ``kv_events``, with replay and
    checkpoints (collector/live.py); the collector's own /metrics on ``metrics_port`` if given."""
    from prometheus_client import start_http_server

    from kvlens.collector.live import CollectorOptions, LiveCollector, build_sources

    if endpoint:
        check_zmq_endpoint(endpoint, "--endpoint", bind=bind)
    if replay:
        check_zmq_endpoint(replay, "--replay")
    if metrics_port is not None:
        check_port_free(metrics_addr, metrics_port, "--metrics-port")
    sources = build_sources(endpoint=endpoint, replay=replay, topic=topic, replica=replica, model=model,
                            bind=bind, config=config)
    collector = LiveCollector(CollectorOptions(lake=lake, sources=sources, keep_tokens=keep_tokens,
                                               record=record, flush_age_s=flush_s, scenario=scenario))
    server = None
    if metrics_port is not None:
        server, _ = start_http_server(metrics_port, addr=metrics_addr, registry=collector.metrics.registry)
    announce(f"collecting {len(sources)} source(s) into {lake} as writer {collector.writer_id}")
    try:
        with stop_scope(until, collector.stop):
            collector.run(duration_s=duration_s)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
    m = collector.metrics
    return tuple(ReplicaEvents(r, int(m.value("kvlens_collector_received_batches_total", replica=r)),
                               int(m.value("kvlens_collector_block_events_total", replica=r)))
                 for r in sorted({p.replica for p in collector.pubs.values()}))


def collect_scrape(lake: str | Path, *, url: str, replica: str, interval_s: float = 15.0,
                   timeout_s: float = 5.0, scenario: str = "live", flush_s: float = 60.0,
                   families: Sequence[str] = (), duration_s: float | None = None,
                   until: StopScope | None = None, announce: Announce = _quiet) -> ScrapeStats:
    """An engine's Prometheus /metrics at ``url`` every ``interval_s`` into ``metric_samples``; the
    scraper's ScrapeStats (collector/scrape.py). ``families``: name prefixes (default: the allow-list)."""
    from kvlens.collector.scrape import DEFAULT_FAMILY_PREFIXES, Scraper

    check_http_url(url, "--url")
    scraper = Scraper(url=url, replica=replica, lake=str(lake), interval_s=interval_s, timeout_s=timeout_s,
                      scenario=scenario, flush_s=flush_s, prefixes=families or DEFAULT_FAMILY_PREFIXES)
    announce(f"scraping {url} every {interval_s:g} s into {lake} as writer scrape-{replica}")
    with stop_scope(until, scraper.stop):
        return scraper.run(duration_s=duration_s)


def collect_scrape_fleet(lake: str | Path, *, config: str, interval_s: float = 15.0, timeout_s: float = 5.0,
                         scenario: str = "live", flush_s: float = 60.0, families: Sequence[str] = (),
                         duration_s: float | None = None, until: StopScope | None = None,
                         announce: Announce = _quiet) -> list[tuple[str, ScrapeStats]]:
    """Every ``metrics_url`` of ``config``'s replicas, one thread and writer each, in one process
    (collector/scrape.py's FleetScraper); (replica, ScrapeStats) per replica."""
    from kvlens.collector.scrape import DEFAULT_FAMILY_PREFIXES, FleetScraper, fleet_targets

    targets = fleet_targets(config)
    fleet = FleetScraper(targets, lake=str(lake), interval_s=interval_s, timeout_s=timeout_s,
                         scenario=scenario, flush_s=flush_s, prefixes=families or DEFAULT_FAMILY_PREFIXES)
    for name, url in targets:
        announce(f"scraping {url} every {interval_s:g} s into {lake} as writer scrape-{name}")
    with stop_scope(until, fleet.stop):
        stats = fleet.run(duration_s=duration_s)
    return [(name, st) for (name, _), st in zip(targets, stats, strict=True)]


def collect_scrapes(lake: str | Path, *, url: str | None = None, replica: str | None = None,
                    config: str | None = None, **knobs: Any) -> list[tuple[str, ScrapeStats]]:
    """``kvlens collect scrape``'s front door: one engine (``url`` with ``replica``: ``collect_scrape``)
    or every replica of ``config`` (``collect_scrape_fleet``), never both; (replica, ScrapeStats) each.
    ``knobs``: their other keywords, ``until`` and ``announce`` among them."""
    if (url is None) == (config is None) or (url is None) != (replica is None):
        raise ConfigError("give --url with --replica (one engine), or --config kvlens.toml (every replica's "
                          "metrics_url)")
    if config is not None:
        return collect_scrape_fleet(lake, config=config, **knobs)
    return [(str(replica), collect_scrape(lake, url=str(url), replica=str(replica), **knobs))]


def collect_otlp(lake: str | Path, *, listen: str = "127.0.0.1:4318",
                 max_body_bytes: int = 16 * 2**20, replica: str | None = None, model: str | None = None,
                 flush_s: float = 5.0,
                 scenario: str = "live", duration_s: float | None = None, until: StopScope | None = None,
                 announce: Announce = _quiet) -> OtlpCollectResult:
    """OTLP/HTTP traces received on ``listen`` (vLLM's llm_request spans) into ``requests``
    (collector/otlp_server.py); GET /metrics on the same port."""
    from kvlens.collector.otlp_server import OtlpReceiver, ReceiverOptions, parse_listen

    host, port = parse_listen(listen)
    receiver = OtlpReceiver(ReceiverOptions(lake=lake, host=host, port=port, replica=replica, model=model,
                                            max_body_bytes=max_body_bytes, flush_age_s=flush_s,
                                            scenario=scenario))
    stop = threading.Event()
    announce(f"receiving OTLP traces on http://{listen}/v1/traces into {lake} as writer {receiver.writer_id}")
    with stop_scope(until, stop.set):
        receiver.run(duration_s=duration_s, stop_event=stop)
    m = receiver.metrics
    return OtlpCollectResult(int(m.value("kvlens_otlp_requests_total")),
                             int(m.value("kvlens_otlp_spans_total", kind="llm_request")),
                             int(m.value("kvlens_otlp_spans_total", kind="other")),
                             int(m.value("kvlens_otlp_written_rows_total")))
