"""The shipped rules and panels in a real Prometheus (Debian's package) scraping ``kvlens export`` on
the demo DB, a recorded vLLM /metrics and the collector's metrics, all on loopback."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from metrics_endpoint import MetricsEndpoint
from prometheus_client import start_http_server
from test_grafana import VLLM_METRICS

from kvlens.collector.live import CollectorMetrics
from kvlens.dashboards.grafana.build import RULES_YAML
from kvlens.dashboards.grafana.spec import RULES, grafana_exprs

REPO = Path(__file__).resolve().parents[1]
PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (Debian: apt-get install "
                                "prometheus; make test installs it when run as root)")
WAIT_S = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _api(port: int, path: str, **params: str) -> Any:
    url = f"http://127.0.0.1:{port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as response:
        reply = json.loads(response.read())
    assert reply["status"] == "success", reply
    return reply["data"]


def _poll(what: str, check: Any, procs: list[subprocess.Popen[bytes]], logs: list[Path]) -> Any:
    """Poll ``check`` (None: not yet) until it answers, a child dies, or WAIT_S pass."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for proc, log in zip(procs, logs, strict=True):
            if proc.poll() is not None:
                pytest.fail(f"{proc.args[0]} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            got = check()
        except OSError:
            got = None
        if got is not None:
            return got
        time.sleep(0.25)  # a polling interval, not a synchronisation: the API is asked again
    pytest.fail(f"{what}: not within {WAIT_S} s:\n" + "\n".join(log.read_text()[-2000:] for log in logs))


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


Stack = tuple[int, list[subprocess.Popen[bytes]], list[Path]]


@pytest.fixture
def stack(demo_workdir: Path, tmp_path: Path) -> Iterator[Stack]:
    vllm = MetricsEndpoint([(200, VLLM_METRICS[0].read_bytes(), 0.0)])  # recorded from a real engine
    metrics = CollectorMetrics()
    metrics.gaps.labels(replica="replica-0")  # the labelled children a running collector has
    metrics.lost_batches.labels(replica="replica-0")
    metrics.decode_errors.labels(reason="bad_frame")
    collector, collector_thread = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
    export_port, prom_port = _free_port(), _free_port()
    logs = [tmp_path / "export.log", tmp_path / "prometheus.log"]
    config = tmp_path / "prometheus.yml"
    jobs = {"kvlens": export_port, "vllm": vllm.port, "collector": collector.server_address[1]}
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES_YAML)],
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
                           for job, port in jobs.items()],
    }))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with logs[0].open("wb") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "kvlens.cli", "export", "--db", str(demo_workdir / "kvlens.duckdb"),
                 "--port", str(export_port)], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": str(REPO)}))
        with logs[1].open("wb") as out:
            procs.append(subprocess.Popen(
                [str(PROMETHEUS), f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=out, stderr=subprocess.STDOUT))
        yield prom_port, procs, logs
    finally:
        for proc in procs:
            _stop(proc)
        vllm.close()
        collector.shutdown()
        collector.server_close()
        collector_thread.join(10)


def _two_scrapes(port: int) -> Any:
    got = _api(port, "query", query="count_over_time(up[1m])")["result"]
    counts = {r["metric"]["job"]: float(r["value"][1]) for r in got}
    up = {r["metric"]["job"]: r["value"][1] for r in _api(port, "query", query="up")["result"]}
    if len(counts) == 3 and min(counts.values()) >= 2 and set(up.values()) == {"1"}:
        return counts
    return None


def _rules_evaluated(port: int) -> Any:
    rules = [r for g in _api(port, "rules")["groups"] for r in g["rules"]]
    if len(rules) == len(RULES) and all(not r["lastEvaluation"].startswith("0001") for r in rules):
        return rules
    return None


def _firing(port: int, alert: str) -> Any:
    return [a for a in _api(port, "alerts")["alerts"]
            if a["labels"]["alertname"] == alert and a["state"] == "firing"] or None


def test_prometheus_serves_every_panel_and_evaluates_every_rule(stack: Stack) -> None:
    port, procs, logs = stack
    _poll("two scrapes of every target", lambda: _two_scrapes(port), procs, logs)
    for expr in grafana_exprs():
        got = _api(port, "query", query=expr)
        assert got["result"], f"no series for the panel query {expr!r}"
    rules = _poll("every rule evaluated", lambda: _rules_evaluated(port), procs, logs)
    assert {r["name"] for r in rules} == {r.alert for r in RULES}
    for r in rules:
        assert r["health"] == "ok", (r["name"], r.get("lastError"))
    firing = _poll("the routing-miss alert", lambda: _firing(port, "KvlensRoutingMissShareHigh"), procs, logs)
    assert {a["labels"]["scenario"] for a in firing} == {"rr8"}
    assert float(firing[0]["value"]) > 0.05
