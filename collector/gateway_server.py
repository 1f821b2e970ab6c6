"""Collector (kvlens gateway): the front door, a running gateway (its event loop in a thread of its own).

``Gateway(options, host, port).start()`` binds the listening socket (port 0: any free port;
``.port`` says which), starts the lake writer and, for ``cache_aware``, the replicas' KV-event
subscriptions; ``stop()`` finishes the requests in flight for up to ``grace_s``, commits what was
recorded and closes everything it opened. The CLI (``kvlens gateway``), the tests and the
benchmark use the same class.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from kvlens.collector.gateway_events import ResidentBlocks
from kvlens.collector.gateway_proxy import GatewayOptions, GatewayProxy
from kvlens.config import check_http_url, load_config
from kvlens.errors import ConfigError
from kvlens.schema import RoutingPolicy
from kvlens.supervise import StopScope, stop_scope

__all__ = ["Gateway", "GatewayOptions", "GatewayResult", "check_options", "serve_gateway"]


def check_options(options: GatewayOptions) -> None:
    """A ConfigError for a fleet the gateway cannot front."""
    if not options.replicas:
        raise ConfigError("the config lists no [[fleet.replicas]]: add each replica with its url")
    missing = [r.name or str(i) for i, r in enumerate(options.replicas) if not r.url]
    if missing:
        raise ConfigError(f"replica(s) {', '.join(missing)} have no url: give each [[fleet.replicas]] its "
                          "OpenAI API, e.g. url = \"http://10.0.0.5:8000\"")


class Gateway:
    def __init__(self, options: GatewayOptions, host: str = "127.0.0.1", port: int = 0, *,
                 grace_s: float = 30.0) -> None:
        check_options(options)
        self.options, self.host, self.requested_port, self.grace_s = options, host, port, grace_s
        cache_aware = options.routing == RoutingPolicy.CACHE_AWARE
        self.resident = ResidentBlocks(options.replicas) if cache_aware else None
        self.proxy = GatewayProxy(options, matched=self.resident.matched if self.resident else None)
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._done: asyncio.Event | None = None
        self._error: BaseException | None = None

    @property
    def metrics(self) -> Any:
        return self.proxy.metrics

    def start(self, timeout_s: float = 30.0) -> Gateway:
        if self.resident is not None:
            self.resident.start()
        self._thread = threading.Thread(target=self._run, name="kvlens-gateway", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise ConfigError(f"the gateway did not start listening on {self.host}:{self.requested_port} "
                              f"within {timeout_s:.0f} s")
        if self._error is not None:
            self.stop()
            raise ConfigError(f"cannot listen on {self.host}:{self.requested_port}: {self._error}; "
                              "pick a free port with --listen") from None
        return self

    def stop(self) -> None:
        if self._loop is not None and self._done is not None:
            self._loop.call_soon_threadsafe(self._done.set)
        if self._thread is not None:
            self._thread.join(self.grace_s + 60)
        if self.resident is not None:
            self.resident.stop()

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._done = asyncio.Event()
        self._runner = web.AppRunner(self.proxy.app, access_log=None, shutdown_timeout=self.grace_s)
        try:
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.host, self.requested_port)
            await site.start()
            self.port = int(self._runner.addresses[0][1])
        except OSError as e:
            self._error = e
            self._ready.set()
            await self._runner.cleanup()
            return
        self._ready.set()
        try:
            await self._done.wait()
        finally:
            await self._runner.cleanup()


@dataclass(frozen=True)
class GatewayResult:
    """What ``serve_gateway`` committed to the lake."""

    requests: int
    blocks: int


def _quiet(_line: str) -> None:
    pass


def serve_gateway(lake: str | Path, *, config: str | Path, listen: str = "127.0.0.1:8000",
                  routing: str = RoutingPolicy.ROUND_ROBIN.value, load_factor: float | None = None,
                  otlp_endpoint: str | None = None, keep_tokens: bool = False, flush_s: float = 1.0,
                  flush_requests: int = 1024, scenario: str = "live", duration_s: float | None = None,
                  until: StopScope | None = None,
                  announce: Callable[[str], object] = _quiet) -> GatewayResult:
    """``kvlens gateway``'s front door: the fleet of ``config`` fronted on ``listen`` until its duration or
    a stop (``until``: the CLI turns SIGTERM/SIGINT into one), every recorded request in ``lake``."""
    from kvlens.collector.otlp_server import parse_listen

    host, port = parse_listen(listen)
    if otlp_endpoint:
        check_http_url(otlp_endpoint, "--otlp-endpoint")
    options = GatewayOptions(replicas=load_config(config).replicas, lake=str(lake), routing=routing,
                             load_factor=load_factor, otlp_endpoint=otlp_endpoint, keep_tokens=keep_tokens,
                             scenario=scenario, flush_age_s=flush_s, flush_requests=flush_requests)
    gateway = Gateway(options, host, port).start()
    announce(f"gateway on http://{host}:{gateway.port} for {len(options.replicas)} replica(s), "
             f"routing {routing}, into {lake}")
    stop = threading.Event()
    try:
        with stop_scope(until, stop.set):
            stop.wait(duration_s)
    finally:
        gateway.stop()
    m = gateway.metrics
    return GatewayResult(int(m.value("kvlens_gateway_rows_written_total", table="requests")),
                         int(m.value("kvlens_gateway_rows_written_total", table="request_blocks")))
