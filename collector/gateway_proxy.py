"""Collector (kvlens gateway): an OpenAI-compatible reverse proxy that records every request's prompt blocks.

``kvlens gateway`` stands in front of the fleet's replicas (``[[fleet.replicas]]`` with ``url``)
on an asyncio HTTP server (aiohttp). For ``POST /v1/completions`` and ``/v1/chat/completions``
it obtains the prompt's token ids from a replica's own tokenizer (collector/gateway_tokens.py),
hashes the full blocks as that replica does, routes (collector/gateway_router.py), forwards the
request and relays the answer unchanged (collector/gateway_relay.py; a replica's error passes
through with its status; an unreachable replica is a 502), then queues one ``requests`` row and
its ``request_blocks`` rows for the lake (collector/gateway_writer.py) and emits one span
(collector/gateway_telemetry.py). ``GET /v1/models`` is forwarded to the first replica that
answers; ``GET /health`` answers 200 while the gateway runs; ``GET /metrics`` is its own.

Recorded per request: the answer's ``id`` as ``request_id``; as ``arrival_ns`` the moment the gateway
sent it to the replica (not the moment it reached the gateway: a request that waits for /tokenize
must not read as arriving before one sent ahead of it, since the ledger orders each replica's
look-ups by arrival); the replica,
the model, the session (the ``X-Session-Id`` header, else the body's ``user``), usage as the
replica reported it (``prompt_tokens``, ``completion_tokens``, ``prompt_tokens_details.cached_tokens``;
vLLM reports the last only with ``--enable-prompt-tokens-details``), and for a streamed answer the
first token's time at the gateway (``ttft_ms``, from the request reaching the gateway, as its client
saw it; a whole JSON answer has no first-token moment the
gateway can see, so its ``ttft_ms`` is NULL and ``end_ns`` is set). A request is forwarded but not
recorded when its prompt cannot be tokenized alone, the replica answered an error, or usage is
missing or disagrees with the token count (``kvlens_gateway_unrecorded_total`` says why).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from prometheus_client import generate_latest

from kvlens.collector.gateway_relay import (
    HOP_HEADERS,
    Observed,
    SseRelay,
    observe_json,
    wants_usage,
    with_usage,
)
from kvlens.collector.gateway_router import Decision, Router
from kvlens.collector.gateway_telemetry import CACHE_READ, REPLICA, ROUTING_REASON, GatewayMetrics, Tracing
from kvlens.collector.gateway_tokens import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    HashKey,
    LocalTokenizer,
    block_rows,
    direct_token_ids,
    full_block_hashes,
    lora_of,
    tokenize_body,
)
from kvlens.collector.gateway_writer import Recorded, RequestWriter
from kvlens.config import ReplicaConfig
from kvlens.schema import RoutingPolicy

__all__ = ["GatewayOptions", "GatewayProxy"]

log = logging.getLogger(__name__)

SESSION_HEADER = "X-Session-Id"
_STATIC = (RoutingPolicy.ROUND_ROBIN, RoutingPolicy.RANDOM)


@dataclass(frozen=True)
class GatewayOptions:
    replicas: tuple[ReplicaConfig, ...]
    lake: str
    routing: str = RoutingPolicy.ROUND_ROBIN.value
    load_factor: float | None = None
    otlp_endpoint: str | None = None
    keep_tokens: bool = False
    scenario: str = "live"
    flush_age_s: float = 1.0
    flush_requests: int = 1024
    queue_requests: int = 4096
    max_body_bytes: int = 32 << 20
    upstream_timeout_s: float = 600.0
    seed: int = 0


@dataclass
class _Call:
    """One proxied generation request as it goes through the gateway."""

    path: str
    body: dict[str, Any]
    raw: bytes
    arrival_ns: int
    session: str | None
    tokens: list[int] | None = None
    decision: Decision | None = None
    sent_ns: int = 0  # when it was sent to the replica: the requests row's arrival_ns
    status: int | None = None  # the replica's answer, once forwarded
    seen: Observed = field(default_factory=Observed)
    end_ns: int = 0


class GatewayProxy:
    """The aiohttp application; ``matched`` (cache_aware) reads each replica's resident prefix."""

    def __init__(self, options: GatewayOptions, *, matched: Callable[[int, Sequence[int]], int] | None = None,
                 metrics: GatewayMetrics | None = None) -> None:
        self.options = options
        self.replicas = options.replicas
        self.names = [r.name or f"replica-{i}" for i, r in enumerate(self.replicas)]
        self.metrics = metrics or GatewayMetrics()
        self.router = Router(len(self.replicas), options.routing, load_factor=options.load_factor,
                             seed=options.seed, matched=matched)
        self.tracing = Tracing(options.otlp_endpoint)
        self.writer = RequestWriter(options.lake, scenario=options.scenario,
                                    writer_id=f"gateway-{uuid.uuid4().hex[:12]}",
                                    flush_age_s=options.flush_age_s, flush_requests=options.flush_requests,
                                    queue_requests=options.queue_requests,
                                    on_written=lambda t, n: self.metrics.rows_written.labels(t).inc(n),
                                    on_error=self.metrics.write_errors.inc)
        self.metrics.queue_depth.set_function(lambda: self.writer.depth)
        self._session: aiohttp.ClientSession | None = None
        self._pending: set[asyncio.Future[None]] = set()  # recordings still being built
        self._tokenizer_next = 0
        self.local = [LocalTokenizer(r.tokenizer, f"replica {self.names[i]}") if r.tokenizer else None
                      for i, r in enumerate(self.replicas)]
        self.app = web.Application(client_max_size=options.max_body_bytes)
        self.app.router.add_post(COMPLETIONS_PATH, self._generate)
        self.app.router.add_post(CHAT_PATH, self._generate)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/metrics", self._metrics)
        self.app.on_startup.append(self._startup)
        self.app.on_cleanup.append(self._cleanup)

    async def _startup(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=self.options.upstream_timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False,
                                              connector=aiohttp.TCPConnector(limit=0))
        self.writer.start()

    async def _cleanup(self, app: web.Application) -> None:
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        await asyncio.get_running_loop().run_in_executor(None, self.writer.stop)
        self.tracing.close()

    # -- plain endpoints ------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "replicas": self.names})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _models(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        last: Exception | None = None
        for i, r in enumerate(self.replicas):
            try:
                async with self._session.get(f"{r.url}/v1/models", headers=_forward_headers(request)) as up:
                    return web.Response(status=up.status, body=await up.read(), headers=_back_headers(up))
            except (aiohttp.ClientError, TimeoutError) as e:
                self.metrics.errors.labels(self.names[i], "unreachable").inc()
                last = e
        return _gateway_error(502, f"no replica answered /v1/models (last: {last})")

    # -- generation ---------------------------------------------------------------------------

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        arrival_ns = time.time_ns()
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return _gateway_error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _gateway_error(400, "the request body is not a JSON object")
        session = request.headers.get(SESSION_HEADER) or (body["user"] if isinstance(body.get("user"), str)
                                                           else None)
        call = _Call(request.path, body, raw, arrival_ns, session,
                     tokens=direct_token_ids(request.path, body))
        if self.options.routing in _STATIC:  # the replica does not depend on the prompt: tokenize there
            call.decision = self._decide(call)
            tokenizing = self._tokenize(call, call.decision.replica) if call.tokens is None else None
            task = asyncio.ensure_future(tokenizing) if tokenizing is not None else None
            response = await self._forward(request, call)
            if task is not None:
                call.tokens = await task
        else:
            if call.tokens is None:
                call.tokens = await self._tokenize(call, self._tokenizer_replica())
            call.decision = self._decide(call)
            response = await self._forward(request, call)
        if call.status == 200 and not getattr(response, "client_gone", False):
            if self.writer.queue.full():  # back-pressure: this answer waits until its row has room
                await self._record(call, call.seen, call.end_ns)
            else:  # hashing and row building off the client's path: its answer goes out now
                task = asyncio.ensure_future(self._record(call, call.seen, call.end_ns))
                self._pending.add(task)
                task.add_done_callback(self._recorded)
        elif call.status is not None:
            self.metrics.unrecorded.labels("replica_error" if call.status != 200 else "client_gone").inc()
        return response

    def _recorded(self, task: asyncio.Future[None]) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:  # a bug: logged, the gateway goes on
            self.metrics.unrecorded.labels("internal_error").inc()
            log.error("gateway: recording a request failed", exc_info=task.exception())

    def _decide(self, call: _Call) -> Decision:
        memo: dict[HashKey, list[int]] = {}

        def hashes(r: int) -> list[int]:
            return self._hashes(call, r, memo)

        decision = self.router.choose(request_id=uuid.uuid4().hex, session=call.session, hashes=hashes)
        self.metrics.routed.labels(self.names[decision.replica], decision.reason).inc()
        return decision

    def _hashes(self, call: _Call, r: int, memo: dict[HashKey, list[int]]) -> list[int]:
        if not call.tokens:
            return []
        replica, key = self.replicas[r], HashKey.of(self.replicas[r])
        lora_name, lora_path = lora_of(replica, call.body.get("model"))
        if lora_name is None and key in memo:
            return memo[key]
        salt = call.body.get("cache_salt") if isinstance(call.body.get("cache_salt"), str) else None
        out = full_block_hashes(call.tokens, key, cache_salt=salt, lora_name=lora_name, lora_path=lora_path)
        if lora_name is None:
            memo[key] = out
        return out

    def _tokenizer_replica(self) -> int:
        r, self._tokenizer_next = self._tokenizer_next, (self._tokenizer_next + 1) % len(self.replicas)
        return r

    async def _tokenize(self, call: _Call, r: int) -> list[int] | None:
        payload = tokenize_body(call.path, call.body)
        if payload is None:
            return None
        assert self._session is not None
        t0 = time.perf_counter()
        try:
            async with self._session.post(f"{self.replicas[r].url}/tokenize", json=payload) as up:
                answer = await up.json(content_type=None) if up.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            log.warning("gateway: /tokenize at %s failed: %s", self.names[r], e)
            answer = None
        self.metrics.tokenize.observe(time.perf_counter() - t0)
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, list):
            self.metrics.errors.labels(self.names[r], "tokenize").inc()
            local = self.local[r]
            if local is None:
                return None
            ids = local.token_ids(call.path, call.body)
            if ids is not None:
                self.metrics.tokenize_local.labels(self.names[r]).inc()
            return ids
        return [int(t) for t in tokens]

    async def _forward(self, request: web.Request, call: _Call) -> web.StreamResponse:
        assert self._session is not None and call.decision is not None
        r = call.decision.replica
        name = self.names[r]
        streaming = call.body.get("stream") is True
        strip = streaming and not wants_usage(call.body)
        raw = json.dumps(with_usage(call.body)).encode() if strip else call.raw
        seen = Observed()
        self.router.begin(r)
        self.metrics.in_flight.labels(name).inc()
        call.sent_ns = time.time_ns()
        try:
            async with self._session.post(f"{self.replicas[r].url}{call.path}", data=raw,
                                          headers=_forward_headers(request)) as up:
                self.metrics.requests.labels(name, str(up.status)).inc()
                if up.status >= 400:
                    self.metrics.errors.labels(name, "status").inc()
                if streaming and up.status == 200 and up.content_type == "text/event-stream":
                    response = await self._relay_stream(request, up, SseRelay(seen, strip_usage=strip), name)
                else:
                    body = await up.read()
                    if up.status == 200:
                        observe_json(body, seen)
                    response = web.Response(status=up.status, body=body, headers=_back_headers(up))
                status = up.status
        except (aiohttp.ClientError, TimeoutError) as e:
            self.metrics.errors.labels(name, "unreachable").inc()
            return _gateway_error(502, f"replica {name} at {self.replicas[r].url} did not answer: {e}")
        finally:
            self.router.end(r)
            self.metrics.in_flight.labels(name).dec()
        call.status, call.seen, call.end_ns = status, seen, time.time_ns()
        return response

    async def _relay_stream(self, request: web.Request, up: aiohttp.ClientResponse, relay: SseRelay,
                            name: str) -> web.StreamResponse:
        response = web.StreamResponse(status=up.status, headers=_back_headers(up))
        await response.prepare(request)
        try:
            async for chunk in up.content.iter_any():
                out = relay.feed(chunk)
                if out:
                    await response.write(out)
            rest = relay.rest()
            if rest:
                await response.write(rest)
            await response.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            self.metrics.errors.labels(name, "client_gone").inc()
            response.client_gone = True  # type: ignore[attr-defined]
        return response

    async def _record(self, call: _Call, seen: Observed, end_ns: int) -> None:
        assert call.decision is not None
        r = call.decision.replica
        usage = seen.usage or {}
        prompt = usage.get("prompt_tokens")
        if call.tokens is None or not isinstance(prompt, int):
            self.metrics.unrecorded.labels("no_tokens" if call.tokens is None else "no_usage").inc()
            self._span(call, seen, end_ns, usage)
            return
        if prompt != len(call.tokens):
            log.warning("gateway: %s reported %d prompt tokens, its tokenizer gave %d; not recorded",
                        self.names[r], prompt, len(call.tokens))
            self.metrics.unrecorded.labels("token_mismatch").inc()
            self._span(call, seen, end_ns, usage)
            return
        row = self._request_row(call, seen, end_ns, usage)
        hashes = self._hashes(call, r, {})
        blocks = block_rows(row["request_id"], call.sent_ns, call.tokens, hashes,
                            self.replicas[r].block_size, row["model"], keep_tokens=self.options.keep_tokens)
        item = Recorded(row, blocks)
        if not self.writer.offer(item):  # full: wait for room (back-pressure), off the event loop
            await asyncio.get_running_loop().run_in_executor(None, self.writer.put, item)
        self._span(call, seen, end_ns, usage)

    def _request_row(self, call: _Call, seen: Observed, end_ns: int, usage: dict[str, Any]) -> dict[str, Any]:
        assert call.decision is not None
        replica = self.replicas[call.decision.replica]
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        first = seen.first_token_ns
        return {"request_id": seen.response_id or f"gw-{uuid.uuid4().hex}", "arrival_ns": call.sent_ns,
                "first_token_ns": first, "end_ns": end_ns, "replica": self.names[call.decision.replica],
                "model": replica.model or _str(call.body.get("model")), "session_id": call.session,
                "prompt_tokens": usage["prompt_tokens"],
                "output_tokens": _int(usage.get("completion_tokens")), "cached_tokens": _int(cached),
                "ttft_ms": (first - call.arrival_ns) / 1e6 if first is not None else None,
                "source": "gateway"}

    def _span(self, call: _Call, seen: Observed, end_ns: int, usage: dict[str, Any]) -> None:
        assert call.decision is not None
        r = call.decision.replica
        url = urlsplit(self.replicas[r].url or "")
        details = usage.get("prompt_tokens_details")
        first = seen.first_token_ns
        ttft_s = (first - call.arrival_ns) / 1e9 if first else None
        self.tracing.span(
            operation="chat" if call.path == CHAT_PATH else "text_completion",
            model=_str(call.body.get("model")), start_ns=call.arrival_ns, end_ns=end_ns,
            attributes={"gen_ai.response.id": seen.response_id,
                        "gen_ai.usage.input_tokens": _int(usage.get("prompt_tokens")),
                        "gen_ai.usage.output_tokens": _int(usage.get("completion_tokens")),
                        CACHE_READ: _int(details.get("cached_tokens")) if isinstance(details, dict) else None,
                        "gen_ai.server.time_to_first_token": ttft_s,
                        "server.address": url.hostname, "server.port": url.port, REPLICA: self.names[r],
                        ROUTING_REASON: call.decision.reason,
                        "kvlens.session.id": call.session})


def _int(value: Any) -> int | None:
    return value if type(value) is int else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _forward_headers(request: web.Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}


def _back_headers(up: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in up.headers.items() if k.lower() not in HOP_HEADERS}


def _gateway_error(status: int, message: str) -> web.Response:
    """An error the gateway itself answers, in the OpenAI error shape."""
    return web.json_response({"error": {"message": message, "type": "gateway_error", "code": status}},
                             status=status)
