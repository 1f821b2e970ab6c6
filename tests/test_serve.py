"""kvlens serve (kvlens/serve.py): the whole tree from one config, against real sockets and processes.

A real pyzmq publisher replays a real vLLM capture's KV-event frames (tests/data/vllm-cpu-capture),
its OTLP spans are posted to serve's receiver, a loopback /metrics serves the engine's exposition.
Each analysis period is checked against a full ``kvlens analyze`` of the lake at that moment;
SIGTERM must leave no process and no bound port; a ``kill -9`` mid-analysis must leave the previous
DB readable, and the next start must complete the period. Every wait is on observable state.
"""

from __future__ import annotations

import base64
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from capture_lines import gateway_lines
from engine_frames import FakeEngine
from metrics_endpoint import MetricsEndpoint
from prometheus_client.parser import text_string_to_metric_families
from serve_checks import alive, descendants, port_free, tables

from kvlens.analyzers.analyze import analyze_lake
from kvlens.collector.imports import import_files
from kvlens.query import query

CAPTURE = Path(__file__).parent / "data" / "vllm-cpu-capture"
_SEQS = "SELECT count(DISTINCT seq) FROM kv_events"
_SPANS = "SELECT count(*) FROM requests WHERE scenario = 'live-spans'"
DEADLINE_S = 240.0  # bounds a failure only: every wait ends as soon as its condition holds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(cond: Callable[[], bool], what: str, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"serve exited ({proc.returncode}) while waiting until {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.05)


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _analyses(port: int) -> float:
    return _scrape(port).get(("kvlens_serve_analyses_total", (("result", "ok"),)), 0.0)


def _same_as_full_analysis(lake: Path, db: Path, tmp: Path, join: tuple[str, ...] = ()) -> None:
    full = tmp / f"full-{time.monotonic_ns()}.duckdb"
    analyze_lake(lake, full, join=join)
    assert tables(db) == tables(full)


class _Serve:
    """``kvlens serve`` as a real process of its own (output to a log file)."""

    def __init__(self, tmp: Path, config: Path, lake: Path, db: Path, *extra: str) -> None:
        self.metrics_port = _free_port()
        self.log = tmp / f"serve-{time.monotonic_ns()}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvlens.cli", "serve", "--config", str(config), "--lake", str(lake),
                 "--db", str(db), "--analyze-every", "2s", "--metrics-port", str(self.metrics_port),
                 "--flush-seconds", "0.2", "--backoff-cap", "2", *extra],
                stdout=out, stderr=subprocess.STDOUT)

    def analyses(self) -> float:
        return _analyses(self.metrics_port)

    def wait_analyses(self, n: float) -> None:
        _wait(lambda: self.analyses() >= n, f"{n:g} analyses ran ({self.log.read_text()[-2000:]})", self.proc)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.destroy(linger=0)


def _frames() -> list[bytes]:
    lines = (CAPTURE / "kv_events.frames.jsonl").read_text().splitlines()
    return [base64.b64decode(json.loads(line)[2]) for line in lines]


def _post_spans(port: int, name: str) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/traces", data=(CAPTURE / name).read_bytes(),
                                 headers={"Content-Type": "application/x-protobuf"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


def _count(lake: Path, sql: str) -> int:
    try:
        return int(query(sql, lake=lake)[1][0][0])
    except Exception:  # the lake has no marker yet: nothing collected
        return 0


def test_serve_runs_the_fleet_analyzes_each_period_and_stops_clean(ctx: zmq.Context[Any],
                                                                    tmp_path: Path) -> None:
    engine = FakeEngine(ctx, b"kv@replica-a@tiny")
    # the engine's /metrics: the capture's exposition for the first two scrapes, then 503
    exposition = (CAPTURE / "metrics.txt").read_bytes()
    metrics = MetricsEndpoint([(200, exposition, 0.0)] * 2 + [(503, b"down\n", 0.0)])
    otlp, export, dashboard = _free_port(), _free_port(), _free_port()
    config = tmp_path / "kvlens.toml"
    config.write_text(f'[[fleet.replicas]]\nname = "replica-a"\nendpoint = "{engine.endpoint}"\n'
                      f'replay_endpoint = "{engine.replay}"\nmetrics_url = "{metrics.url}"\n')
    lake, db = tmp_path / "lake", tmp_path / "kvlens.duckdb"
    # what a gateway in front of the engine records: each request's blocks (the KV events then
    # arrive through serve's collector, the spans through its receiver)
    import_files("gateway", [gateway_lines(CAPTURE, tmp_path / "gateway.jsonl")], lake, scenario="live")
    serve = _Serve(tmp_path, config, lake, db, "--otlp-listen", f"127.0.0.1:{otlp}", "--export-port",
                   str(export), "--scrape-interval", "0.1", "--dashboard", "--dashboard-port", str(dashboard))
    try:
        _wait(lambda: bool(engine.pub.poll(100)), "the collector subscribed", serve.proc)
        engine.pub.recv()  # XPUB's subscription message
        frames = _frames()
        half = len(frames) // 2
        periods = [(frames[:half], "otlp_000.pb"), (frames[half:], "otlp_001.pb")]
        for i, (payloads, spans) in enumerate(periods):
            for p in payloads:
                engine.publish(p)
            had = _count(lake, _SPANS)
            _wait(lambda spans=spans: _try_post(otlp, spans), "the OTLP receiver took the spans", serve.proc)
            sent = half if i == 0 else len(frames)
            _wait(lambda sent=sent: _count(lake, _SEQS) == sent, "every batch sent so far is in the lake",
                  serve.proc)
            _wait(lambda: _count(lake, "SELECT count(*) FROM metric_samples") > 0 and metrics.hits > 2,
                  "two scrapes landed", serve.proc)
            _wait(lambda had=had: _count(lake, _SPANS) > had, "the spans' requests are in the lake",
                  serve.proc)
            # an analysis that started after the data landed has finished
            serve.wait_analyses(serve.analyses() + 2)
            _same_as_full_analysis(lake, db, tmp_path, join=("live-spans",))
        joined = query("SELECT source_scenario FROM request_sources", db=db)[1]
        assert joined == [("live-spans",)]  # the receiver's spans were joined into the gateway's requests
        m = _scrape(serve.metrics_port)
        assert m[("kvlens_serve_child_up", (("child", "collect-vllm"),))] == 1
        assert m[("kvlens_serve_child_up", (("child", "export"),))] == 1
        assert m[("kvlens_serve_last_analysis_duration_seconds", ())] > 0
        assert m[("kvlens_serve_last_analysis_peak_rss_bytes", ())] > 64 << 20  # its VmHWM, as read
        exported = _scrape(export)
        assert any(name.startswith("kvlens_") for name, _ in exported)  # the export serves the new DB
        _wait(lambda: _answers(f"http://127.0.0.1:{dashboard}/_stcore/health"), "the dashboard serves",
              serve.proc)
        kids = descendants(serve.proc.pid)
        # collect vllm, scrape, otlp, export, kvlens dashboard and its Streamlit (maybe an analysis)
        assert len(kids) >= 6
        serve.proc.send_signal(signal.SIGTERM)
        assert serve.proc.wait(timeout=DEADLINE_S) == 0, serve.log.read_text()[-3000:]
    finally:
        serve.close()
        engine.close()
        metrics.close()
    assert not [p for p in kids if alive(p)]
    for port in (otlp, export, dashboard, serve.metrics_port):
        assert port_free(port), f"port {port} still bound after SIGTERM"
    # the collectors flushed on their way out: nothing they took is missing
    assert _count(lake, _SEQS) == len(frames)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _try_post(port: int, name: str) -> bool:
    try:
        _post_spans(port, name)
    except (urllib.error.URLError, ConnectionError):
        return False
    return True


def test_kill_9_mid_analysis_keeps_the_previous_db_and_the_next_start_completes_it(
        tmp_path: Path, mooncake3: Path) -> None:
    lake, db = tmp_path / "lake", tmp_path / "kvlens.duckdb"
    import_files("mooncake", [mooncake3], lake, scenario="conv")
    config = tmp_path / "kvlens.toml"
    config.write_text("# no replicas: serve runs only the periodic analysis here\n")
    serve = _Serve(tmp_path, config, lake, db, "--otlp-listen", "off", "--no-export")
    try:
        serve.wait_analyses(1)
        before = tables(db)
        # the next period's analysis is running: kill serve with it
        analyze: list[int] = []

        def analysing() -> bool:
            analyze[:] = [p for p in descendants(serve.proc.pid) if b"analyze" in _cmdline(p)]
            return bool(analyze)

        _wait(analysing, "the next analysis started", serve.proc)
        serve.proc.kill()
        serve.proc.wait()
    finally:
        serve.close()
    _wait(lambda: not [p for p in analyze if alive(p)], "the killed serve's analysis died with it")
    assert tables(db) == before  # the previous DB, whole and readable
    _same_as_full_analysis(lake, db, tmp_path)
    mtime = db.stat().st_mtime_ns
    serve = _Serve(tmp_path, config, lake, db, "--otlp-listen", "off", "--no-export")
    try:
        serve.wait_analyses(1)  # the next start completes the period
        serve.proc.send_signal(signal.SIGTERM)
        assert serve.proc.wait(timeout=DEADLINE_S) == 0
    finally:
        serve.close()
    assert db.stat().st_mtime_ns > mtime
    _same_as_full_analysis(lake, db, tmp_path)
    assert not list(tmp_path.glob(".kvlens.duckdb.*")), "a killed build's leftovers stayed"


def test_an_analysis_past_its_memory_limit_stops_and_serve_counts_it_and_goes_on(
        tmp_path: Path, mooncake3: Path) -> None:
    lake, db = tmp_path / "lake", tmp_path / "kvlens.duckdb"
    import_files("mooncake", [mooncake3], lake, scenario="conv")
    analyze_lake(lake, db)  # the previous DB, which every stopped analysis leaves as it was
    before = tables(db)
    mtime = db.stat().st_mtime_ns
    config = tmp_path / "kvlens.toml"
    config.write_text("# no replicas: serve runs only the periodic analysis here\n")
    # far below what any analysis holds: each one stops (exit status 3)
    serve = _Serve(tmp_path, config, lake, db, "--otlp-listen", "off", "--no-export",
                   "--analyze-memory-limit", "64MiB")
    over = ("kvlens_serve_analyses_total", (("result", "over_memory_limit"),))
    try:
        _wait(lambda: _scrape(serve.metrics_port).get(over, 0.0) >= 2,
              f"two analyses stopped at the limit ({serve.log.read_text()[-2000:]})", serve.proc)
        got = _scrape(serve.metrics_port)
        assert got.get(("kvlens_serve_analyses_total", (("result", "ok"),)), 0.0) == 0
        assert got.get(("kvlens_serve_analyses_total", (("result", "failed"),)), 0.0) == 0
        assert got[("kvlens_serve_child_last_exit_status", (("child", "analyze"),))] == 3
        serve.proc.send_signal(signal.SIGTERM)
        assert serve.proc.wait(timeout=DEADLINE_S) == 0
    finally:
        serve.close()
    log = serve.log.read_text()
    assert "over --memory-limit 64 MiB" in log and "stopped at --analyze-memory-limit 64 MiB" in log
    assert db.stat().st_mtime_ns == mtime and tables(db) == before


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_a_crashing_child_is_restarted_with_capped_backoff_and_counted(tmp_path: Path) -> None:
    from kvlens.serve import ChildSpec, ServeOptions, Serving

    config = tmp_path / "kvlens.toml"
    config.write_text("")
    marker = tmp_path / "starts"
    crash = ("import sys, pathlib; p = pathlib.Path(sys.argv[1]); "
             "p.write_text(p.read_text() + 'x' if p.exists() else 'x'); sys.exit(3)")
    opts = ServeOptions(config=str(config), lake=str(tmp_path / "lake"), db=str(tmp_path / "db.duckdb"),
                        analyze_every_s=3600.0, export_port=None, otlp_listen=None, backoff_s=0.05,
                        backoff_cap_s=0.2, kvlens=(sys.executable, "-c", crash))
    serving = Serving(opts, specs=(ChildSpec("crasher", lambda o, c: [str(marker)]),))
    serving._next_analysis = float("inf")  # only the crashing child here
    done = threading.Event()

    def stop_after_restarts() -> None:
        deadline = time.monotonic() + DEADLINE_S
        while serving.metrics.value("kvlens_serve_child_restarts_total", child="crasher") < 5:
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        serving.stop()
        done.set()

    watcher = threading.Thread(target=stop_after_restarts)
    watcher.start()
    serving.run()  # the main thread: the supervisor's children die with the thread that forked them
    watcher.join()
    m = serving.metrics
    assert m.value("kvlens_serve_child_restarts_total", child="crasher") >= 5
    assert m.value("kvlens_serve_child_last_exit_status", child="crasher") == 3
    assert len(marker.read_text()) >= 5  # it really ran each time
    assert done.is_set() and not serving.sup.children  # stopped, and none left running


def test_backoff_doubles_to_the_cap_and_resets_after_a_long_run(tmp_path: Path) -> None:
    from kvlens.serve import ChildSpec, ServeOptions, Serving

    config = tmp_path / "kvlens.toml"
    config.write_text("")
    opts = ServeOptions(config=str(config), lake=str(tmp_path), db=str(tmp_path / "db"), export_port=None,
                        otlp_listen=None, backoff_s=1.0, backoff_cap_s=8.0)
    serving = Serving(opts, specs=(ChildSpec("c", lambda o, c: []),))
    st = serving._state["c"]
    delays = []
    for now in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):  # it dies at once each time
        st.started = now - 0.5
        serving._exited("c", 1, now)
        delays.append(st.due - now)
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    st.started = 100.0
    serving._exited("c", 1, 100.0 + 8.0)  # it ran for the cap: the next wait starts over
    assert st.due - 108.0 == 1.0
    assert serving.metrics.value("kvlens_serve_child_restarts_total", child="c") == 7


def test_children_are_data_driven_and_the_gateway_runs_only_when_configured(tmp_path: Path) -> None:
    from kvlens.serve import ServeOptions, Serving

    config = tmp_path / "kvlens.toml"
    config.write_text('[[fleet.replicas]]\nname = "a"\nendpoint = "tcp://127.0.0.1:5557"\n'
                      'metrics_url = "http://127.0.0.1:8000/metrics"\n')
    opts = ServeOptions(config=str(config), lake="lake", db="db.duckdb", otlp_listen=None)
    assert list(Serving(opts).daemons) == ["collect-vllm", "scrape", "export"]
    config.write_text(config.read_text() + "[gateway]\n")
    _, argv = Serving(opts).daemons["gateway"]
    assert argv[:5] == ["gateway", "--config", str(config), "--lake", "lake"]


def test_the_readmes_systemd_unit_and_deployment_run_flags_serve_accepts() -> None:
    import re
    import shlex

    from click.testing import CliRunner

    from kvlens.cli import cli

    repo = Path(__file__).resolve().parents[1]
    readme = (repo / "README.md").read_text()
    unit = re.search(r"^ExecStart=\S+ (serve .*)$", readme, re.M)
    deployment = re.search(r'args: (\["serve".*?\])', readme, re.S)
    docker = re.search(r"^CMD (\[.*\])$", (repo / "Dockerfile").read_text(), re.M)
    assert unit and deployment and docker
    for args in (shlex.split(unit.group(1)), json.loads(deployment.group(1)), json.loads(docker.group(1))):
        result = CliRunner().invoke(cli, [*args, "--help"])  # eager --help: every option before it exists
        assert result.exit_code == 0 and args[0] == "serve", (args, result.output)


def test_a_busy_gateway_port_is_refused_before_any_child_starts(tmp_path: Path) -> None:
    """The gateway binds --gateway-listen in its child: a port in use would only show as a restart loop."""
    from kvlens.errors import ConfigError
    from kvlens.serve import ServeOptions, run_serve

    config = tmp_path / "kvlens.toml"
    config.write_text('[[fleet.replicas]]\nname = "a"\nendpoint = "tcp://127.0.0.1:5557"\n'
                      'url = "http://127.0.0.1:8001"\n')
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        opts = ServeOptions(config=str(config), lake=str(tmp_path / "lake"), db=str(tmp_path / "db.duckdb"),
                            otlp_listen=None, export_port=None, gateway_listen=f"127.0.0.1:{port}")
        with pytest.raises(ConfigError, match="--gateway-listen"):
            run_serve(opts, otlp_address=None)
        bad = ServeOptions(config=str(config), lake="lake", db="db", otlp_listen=None, export_port=None,
                           gateway_listen="nowhere")
        with pytest.raises(ConfigError, match="--gateway-listen 'nowhere' is not HOST:PORT"):
            run_serve(bad, otlp_address=None)
    # without a gateway in the config, the flag's default port is not this fleet's concern
    config.write_text('[[fleet.replicas]]\nname = "a"\nendpoint = "tcp://127.0.0.1:5557"\n')
    from kvlens.config import load_config
    from kvlens.serve import check_ports

    check_ports(ServeOptions(config=str(config), lake="l", db="d", otlp_listen=None, export_port=None,
                             gateway_listen="nowhere"), None, load_config(str(config)))
