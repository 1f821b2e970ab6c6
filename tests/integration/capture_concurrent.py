"""Makes tests/data/vllm-concurrent-capture/: a real vLLM serving several client threads at once.

Run with kvlens's Python (it needs pyzmq) and point it at the engine's Python:

    .venv/bin/python tests/integration/capture_concurrent.py --vllm-python .venv-vllm/bin/python OUT_DIR

It makes the tiny random-weight Llama (make_tiny_model.py), binds a ZMQ SUB socket the engine's
KV-event publisher connects to and an OTLP/HTTP receiver its span exporter posts to (both on
127.0.0.1), starts ``vllm.entrypoints.openai.api_server`` with the flags in ENGINE_FLAGS, and
runs THREADS client threads, each a closed loop (send, wait for the answer, think 50-400 ms,
send the next) over its own sessions: shared system prompts, then turns that grow the
session's prompt. It writes what the engine emitted and what the clients saw (README.md
beside the output says what each file holds). The engine is stopped with SIGTERM (its span
exporter flushes then) and killed if it lingers; it also dies with this process (PDEATHSIG).
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import http.server
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import zmq

HERE = Path(__file__).parent
THREADS = 6
REQUESTS_PER_THREAD = 60
BLOCK = 32
ENGINE_FLAGS = [
    "--block-size", str(BLOCK), "--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256_cbor",
    "--enable-prompt-tokens-details", "--num-gpu-blocks-override", "128", "--max-num-seqs", "8",
    "--max-num-batched-tokens", "2048", "--dtype", "bfloat16", "--max-model-len", "2048",
    "--gpu-memory-utilization", "0.1",
]
ENGINE_ENV = {"PYTHONHASHSEED": "0", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
              "HF_HUB_OFFLINE": "1"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class _Spans(http.server.ThreadingHTTPServer):
    def __init__(self, out: Path) -> None:
        super().__init__(("127.0.0.1", 0), _SpanHandler)
        self.out, self.n, self.lock = out, 0, threading.Lock()


class _SpanHandler(http.server.BaseHTTPRequestHandler):
    server: _Spans

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with self.server.lock:
            (self.server.out / f"otlp_{self.server.n:03d}.pb").write_bytes(body)
            self.server.n += 1
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def _subscriber(ctx: zmq.Context[Any], port: int, out: Path, stop: threading.Event) -> threading.Thread:
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.bind(f"tcp://127.0.0.1:{port}")

    def loop() -> None:
        with open(out / "kv_events.frames.jsonl", "w") as f:
            while not stop.is_set():
                if sock.poll(200):
                    frames = sock.recv_multipart()
                    f.write(json.dumps([base64.b64encode(x).decode() for x in frames]) + "\n")
        sock.close(linger=0)

    thread = threading.Thread(target=loop)
    thread.start()
    return thread


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def _client(k: int, url: str, model: str, vocab: int, systems: list[list[int]], lines: list[dict[str, Any]],
            lock: threading.Lock, chat: bool = False) -> None:
    rng = random.Random(100 + k)
    sessions: dict[str, list[int]] = {}
    for _ in range(REQUESTS_PER_THREAD):
        name = f"t{k}s{rng.randrange(3)}"
        if name not in sessions or rng.random() < 0.2 or len(sessions[name]) > 1200:
            sessions[name] = list(rng.choice(systems))
        sessions[name] += [rng.randrange(2, vocab) for _ in range(rng.randrange(30, 130))]
        prompt, max_tokens = list(sessions[name]), rng.randrange(16, 97) if chat else rng.randrange(4, 33)
        sent = time.time()
        reply = _post(url, {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "user": name, **({"return_token_ids": True} if chat else {})})
        if chat:  # the next turn's prompt holds this answer, whose full blocks the engine cached as it
            # decoded them
            sessions[name] += reply["choices"][0]["token_ids"]
        with lock:
            lines.append({"request_id": reply["id"], "arrival_unix": sent, "done_unix": time.time(),
                          "thread": k, "session": name, "max_tokens": max_tokens, "prompt_token_ids": prompt,
                          "usage": reply["usage"]})
        time.sleep(0.05 + rng.random() * 0.35)  # think: keeps the engine below saturation


def _wait_healthy(url: str, engine: subprocess.Popen[bytes], timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if engine.poll() is not None:
            raise SystemExit(f"the engine exited ({engine.returncode}); see its log")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise SystemExit("the engine was not healthy in time")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--arch", choices=("llama", "gemma2"), default="llama",
                    help="gemma2: the hybrid model (a sliding-window and a full-attention KV cache group "
                         "in one pool, which needs 160 blocks: make_tiny_model.py)")
    ap.add_argument("--gpu-blocks", type=int, default=None,
                    help="the engine's KV cache blocks (--num-gpu-blocks-override), fewer than the default "
                         "to make it preempt running requests; --max-model-len shrinks to fit them")
    ap.add_argument("--threads", type=int, default=THREADS, help="client threads (closed loops)")
    ap.add_argument("--chat", action="store_true",
                    help="each turn's prompt holds the session's earlier answers (16-96 output tokens each)")
    ap.add_argument("--batched-tokens", type=int, default=None,
                    help="the engine's --max-num-batched-tokens (below a prompt's length: a chunked prefill)")
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvlens-capture-"))
    model = work / ("tiny" if args.arch == "llama" else "tiny-gemma2")
    subprocess.run([args.vllm_python, str(HERE / "make_tiny_model.py"), str(model), args.arch], check=True,
                   timeout=600)
    flags = list(ENGINE_FLAGS)
    if args.arch == "gemma2":  # two groups share the pool: a 2,048-token request needs 64 blocks in each
        flags[flags.index("--num-gpu-blocks-override") + 1] = "160"
    if args.batched_tokens is not None:
        flags[flags.index("--max-num-batched-tokens") + 1] = str(args.batched_tokens)
    if args.gpu_blocks is not None:
        flags[flags.index("--num-gpu-blocks-override") + 1] = str(args.gpu_blocks)
        groups = 2 if args.arch == "gemma2" else 1
        most = int(flags[flags.index("--max-model-len") + 1])
        # (one block of the pool is vLLM's null block)
        flags[flags.index("--max-model-len") + 1] = str(min(most, (args.gpu_blocks - 1) // groups * BLOCK))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    ev_port, replay_port, api = _port(), _port(), _port()
    spans = _Spans(out)
    threading.Thread(target=spans.serve_forever, daemon=True).start()
    ctx: zmq.Context[Any] = zmq.Context()
    stop = threading.Event()
    sub = _subscriber(ctx, ev_port, out, stop)
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{ev_port}",
              "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": f"kv@replica-a@{model.name}"}
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host",
           "127.0.0.1", "--port", str(api), *flags, "--otlp-traces-endpoint",
           f"http://127.0.0.1:{spans.server_address[1]}/v1/traces", "--kv-events-config", json.dumps(events)]
    (out / "engine_cmd.json").write_text(json.dumps({"argv": cmd[1:], "env": ENGINE_ENV}, indent=1) + "\n")
    with open(work / "engine.log", "wb") as log:
        engine = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **ENGINE_ENV},
                                  preexec_fn=_die_with_parent)
    try:
        _wait_healthy(f"http://127.0.0.1:{api}/health", engine)
        time.sleep(2)  # let the publisher connect before the first batch
        rng = random.Random(7)
        lengths = [rng.choice((96, 160, 224, 288)) for _ in range(6)]
        systems = [[rng.randrange(2, vocab) for _ in range(n)] for n in lengths]
        lines: list[dict[str, Any]] = []
        lock = threading.Lock()
        url = f"http://127.0.0.1:{api}/v1/completions"
        t0 = time.time()
        clients = [threading.Thread(target=_client, args=(k, url, str(model), vocab, systems, lines, lock,
                                                          args.chat)) for k in range(args.threads)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        print(f"{len(lines)} requests in {time.time() - t0:.1f} s", file=sys.stderr)
        with urllib.request.urlopen(f"http://127.0.0.1:{api}/metrics", timeout=30) as r:
            (out / "metrics.txt").write_bytes(r.read())
        lines.sort(key=lambda x: x["arrival_unix"])
        (out / "client.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    finally:
        engine.send_signal(signal.SIGTERM)
        try:
            engine.wait(120)
        except subprocess.TimeoutExpired:
            engine.kill()
            engine.wait()
        time.sleep(1)
        stop.set()
        sub.join()
        spans.shutdown()
        spans.server_close()
        ctx.term()
        print(f"engine log: {work / 'engine.log'}", file=sys.stderr)
        shutil.rmtree(model, ignore_errors=True)


if __name__ == "__main__":
    main()
