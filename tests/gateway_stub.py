"""A stub OpenAI-compatible engine on 127.0.0.1 for the gateway's tests and benchmark: a real HTTP server.

It answers like vLLM's OpenAI server in the shapes the gateway reads: ``POST /tokenize`` (prompt
or chat messages -> ``{"count", "max_model_len", "tokens"}``), ``/v1/completions`` and
``/v1/chat/completions`` (whole JSON, or SSE with the final usage chunk when
``stream_options.include_usage``), ``/v1/models``, ``/health``. Its prefix cache remembers every
full block it has seen (vLLM's hashes, kvlens's hasher) and reports ``cached_tokens`` as vLLM
does (at least one prompt token is computed). With ``publish`` it sends each request's new
blocks as a vLLM ``BlockStored`` batch on a ZMQ PUB socket. A prompt ``"fail"`` is answered 400;
tokenizing ``"slow"`` waits for the test's ``release``.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from typing import Any

import msgspec
import zmq

from kvlens.collector.hashing import vllm_block_hashes

__all__ = ["StubEngine", "stub_tokens"]


def stub_tokens(text: str) -> list[int]:
    """The stub's tokenizer: one token per character."""
    return [2 + ord(c) % 5000 for c in text]


def _chat_text(body: dict[str, Any]) -> str:
    text = "".join(f"<{m.get('role')}>{m.get('content')}" for m in body.get("messages", []))
    return text + ("<assistant>" if body.get("add_generation_prompt", True) else "")


class StubEngine(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, *, block_size: int = 4, algo: str = "sha256_cbor", seed: str | None = "0",
                 publish: bool = False, name: str = "stub") -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.block_size, self.algo, self.seed, self.name = block_size, algo, seed, name
        self.cache: set[int] = set()
        self.lock = threading.Lock()
        self.bodies: list[tuple[str, dict[str, Any]]] = []
        self.n = 0
        self.tokenize_down = False  # answer /tokenize with 404 (tests of the local tokenizer fallback)
        # a /tokenize of the prompt "slow" signals ``slow_seen`` and waits for ``release`` (tests)
        self.slow_seen, self.release = threading.Event(), threading.Event()
        self._ctx: zmq.Context[Any] | None = None
        self._pub: zmq.Socket[Any] | None = None
        self.endpoint = "tcp://127.0.0.1:1"
        self._seq = 0
        if publish:
            self._ctx = zmq.Context()
            self._pub = self._ctx.socket(zmq.PUB)
            port = self._pub.bind_to_random_port("tcp://127.0.0.1")
            self.endpoint = f"tcp://127.0.0.1:{port}"
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> StubEngine:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join(10)
        if self._pub is not None and self._ctx is not None:
            self._pub.close(linger=0)
            self._ctx.term()

    def prompt_ids(self, path: str, body: dict[str, Any]) -> list[int]:
        if path.endswith("/chat/completions") or "messages" in body:
            return stub_tokens(_chat_text(body))
        prompt = body["prompt"]
        return list(prompt) if isinstance(prompt, list) else stub_tokens(prompt)

    def admit(self, tokens: list[int], salt: str | None) -> int:
        """cached_tokens for this prompt, as vLLM counts them; its blocks are then cached (and published)."""
        hashes = [b.value for b in vllm_block_hashes(tokens, self.block_size, algo=self.algo, seed=self.seed,
                                                      cache_salt=salt)]
        with self.lock:
            hit = 0
            for h in hashes:
                if h not in self.cache:
                    break
                hit += 1
            if hit * self.block_size == len(tokens):
                hit -= 1  # vLLM computes at least the last prompt token
            new = [h for h in hashes if h not in self.cache]
            self.cache.update(hashes)
            if new and self._pub is not None:
                self._publish(new)
        return hit * self.block_size

    def publish_blocks(self, tokens: list[int]) -> None:
        """Publish the full blocks of ``tokens`` as stored (without caching them)."""
        with self.lock:
            self._publish([b.value for b in vllm_block_hashes(tokens, self.block_size, algo=self.algo,
                                                               seed=self.seed)])

    def _publish(self, hashes: list[int]) -> None:
        assert self._pub is not None
        event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": [],
                 "block_size": self.block_size, "lora_id": None, "medium": "GPU"}
        payload = msgspec.msgpack.encode([time.time(), [event], None])
        self._seq += 1
        self._pub.send_multipart([b"", self._seq.to_bytes(8, "big"), payload])


class _Handler(http.server.BaseHTTPRequestHandler):
    server: StubEngine
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as separate writes: no 40 ms delayed-ACK stall

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _send(self, status: int, obj: Any, content_type: str = "application/json") -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        elif self.path == "/health":
            self._send(200, {})
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.bodies.append((self.path, body))
        if self.path == "/tokenize" and body.get("prompt") == "slow":
            self.server.slow_seen.set()
            self.server.release.wait(30)
        if self.path == "/tokenize" and self.server.tokenize_down:
            self._send(404, {"error": "not found"})  # an engine without vLLM's /tokenize
            return
        if self.path == "/tokenize":
            tokens = stub_tokens(_chat_text(body) if "messages" in body else body["prompt"])
            self._send(200, {"count": len(tokens), "max_model_len": 2048, "tokens": tokens})
            return
        if body.get("prompt") == "fail":
            self._send(400, {"object": "error", "message": "the stub refuses 'fail'", "code": 400})
            return
        tokens = self.server.prompt_ids(self.path, body)
        cached = self.server.admit(tokens, body.get("cache_salt"))
        n_out = int(body.get("max_tokens", 4))
        with self.server.lock:
            self.server.n += 1
            rid = f"cmpl-{self.server.name}-{self.server.n}"
        usage = {"prompt_tokens": len(tokens), "completion_tokens": n_out,
                 "total_tokens": len(tokens) + n_out, "prompt_tokens_details": {"cached_tokens": cached}}
        if body.get("stream"):
            self._stream(rid, n_out, usage, bool((body.get("stream_options") or {}).get("include_usage")))
        else:
            self._send(200, {"id": rid, "object": "text_completion",
                             "choices": [{"index": 0, "text": "x" * n_out}], "usage": usage})

    def _stream(self, rid: str, n_out: int, usage: dict[str, Any], include_usage: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = [{"id": rid, "choices": [{"index": 0, "text": "x"}]} for _ in range(n_out)]
        if include_usage:
            events.append({"id": rid, "choices": [], "usage": usage})
        for e in [*(f"data: {json.dumps(e)}\n\n" for e in events), "data: [DONE]\n\n"]:
            data = e.encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")
