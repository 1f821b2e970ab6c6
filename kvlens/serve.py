"""The spine's ``kvlens serve``: the whole fleet from one config, as one supervised process tree.

Each child is a ``kvlens`` command of its own (``CHILDREN``: adding one is one entry), started
through kvlens/supervise.py's ``Supervisor`` (own process group, dies with serve, SIGKILL after
the grace period):

- ``collect-vllm``: the KV-event collector for every replica of the config (``collect vllm --config``);
- ``scrape``: every replica's ``metrics_url`` in one process (``collect scrape --config``);
- ``otlp``: the OTLP/HTTP receiver (``--otlp-listen``), into scenario ``live-spans``, which the
  analysis joins into ``live`` by request id (``analyze_args``);
- ``gateway``: when the config has a ``[gateway]`` table or a replica with a ``url``
  (``--gateway-listen``);
- ``export``: the Prometheus export of the analysis DB, and ``dashboard`` with ``--dashboard``;
  both start once the DB exists.

A child that exits is restarted after a back-off that doubles from ``backoff_s`` up to
``backoff_cap_s`` (reset once it has run for the cap), and counted. Every ``analyze_every_s``
a ``kvlens analyze --compact`` runs as a child too (the collectors' small segments merged first,
kvlens/compact.py: every query reads every segment), so a crash or a kill of it cannot take serve down;
it writes the DB under a temporary name and renames it into place (kvlens/analysis_db.py), so
a ``kill -9`` of serve mid-analysis (the analysis dies with it) leaves the previous DB whole,
and the next start analyzes at once when the DB is older than one period. serve's own
``/metrics`` (``--metrics-port``) counts restarts by child, last exit statuses, analyses run
and the last analysis's duration, all measured. ``--analyze-memory-limit`` gives every analysis a
``--memory-limit`` (kvlens/memory.py): one that grows past it stops itself (status 3, counted
``over_memory_limit``) before the kernel's OOM killer picks a collector. SIGTERM or SIGINT stop
every child (the collectors flush on their SIGTERM) and return; any other death of serve ends them
too (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvlens.config import Config, load_config
from kvlens.errors import MEMORY_EXIT, ConfigError
from kvlens.memory import format_bytes, peak_resident_bytes
from kvlens.supervise import StopScope, Supervisor, parse_listen, stop_scope

__all__ = [
    "CHILDREN", "SPANS_SCENARIO", "ChildSpec", "ServeMetrics", "ServeOptions", "Serving", "analyze_args",
    "check_ports", "run_serve", "serve_fleet", "serve_metrics",
]

log = logging.getLogger(__name__)

ANALYZE = "analyze"
SPANS_SCENARIO = "live-spans"  # where serve's OTLP receiver writes (joined into the analysis)


@dataclass(frozen=True)
class ServeOptions:
    config: str
    lake: str
    db: str
    analyze_every_s: float = 300.0
    analyze_memory_limit: int | None = None  # bytes: each analysis' --memory-limit (kvlens/memory.py)
    dashboard: bool = False
    dashboard_port: int = 8501
    metrics_port: int | None = None
    host: str = "127.0.0.1"  # where serve's /metrics, the export and the dashboard bind
    export_port: int | None = 9465
    otlp_listen: str | None = "127.0.0.1:4318"
    gateway_listen: str | None = "127.0.0.1:8000"
    flush_s: float = 5.0
    scrape_interval_s: float = 15.0
    backoff_s: float = 1.0
    backoff_cap_s: float = 60.0
    grace_s: float = 10.0
    kvlens: tuple[str, ...] = field(default_factory=lambda: (sys.executable, "-m", "kvlens.cli"))


Argv = Callable[[ServeOptions, Config], list[str] | None]


@dataclass(frozen=True)
class ChildSpec:
    """A long-running child: its name, its kvlens arguments (None: not configured), whether it
    needs the analysis DB to exist before it starts."""

    name: str
    argv: Argv
    needs_db: bool = False


def _collect_vllm(o: ServeOptions, c: Config) -> list[str] | None:
    if not c.replicas:
        return None
    return ["collect", "vllm", "--config", o.config, "--lake", o.lake, "--flush-seconds", f"{o.flush_s:g}"]


def _scrape(o: ServeOptions, c: Config) -> list[str] | None:
    if not any(r.metrics_url for r in c.replicas):
        return None
    return ["collect", "scrape", "--config", o.config, "--lake", o.lake, "--flush-seconds", f"{o.flush_s:g}",
            "--interval", f"{o.scrape_interval_s:g}"]


def _otlp(o: ServeOptions, c: Config) -> list[str] | None:
    if not o.otlp_listen:
        return None
    return ["collect", "otlp", "--listen", o.otlp_listen, "--lake", o.lake, "--scenario", SPANS_SCENARIO,
            "--flush-seconds", f"{o.flush_s:g}"]


def analyze_args(o: ServeOptions) -> list[str]:
    """The periodic ``kvlens analyze``: the lake's scenarios, the spans joined once there are any.

    Spans go to their own scenario (``live-spans``): joined by request id they fill the timings
    of the requests the gateway recorded with their blocks (``live``), as ``--join`` documents;
    in ``live`` itself, requests without blocks would make the analysis refuse the scenario.
    """
    args = ["analyze", "--lake", o.lake, "--db", o.db, "--compact"]
    if o.analyze_memory_limit is not None:
        args += ["--memory-limit", str(o.analyze_memory_limit)]
    if any((Path(o.lake) / "requests" / f"scenario={SPANS_SCENARIO}").glob("date=*/*.parquet")):
        args += ["--join", SPANS_SCENARIO]
    return args


def _gateway_configured(c: Config) -> bool:
    """A ``[gateway]`` table, or a replica with an OpenAI ``url`` (what kvlens gateway forwards to)."""
    fleet = c.raw.get("fleet")
    entries = fleet.get("replicas", []) if isinstance(fleet, dict) else []
    return "gateway" in c.raw or any(isinstance(e, dict) and "url" in e for e in entries)


def _gateway(o: ServeOptions, c: Config) -> list[str] | None:
    if not o.gateway_listen or not _gateway_configured(c):
        return None
    return ["gateway", "--config", o.config, "--lake", o.lake, "--listen", o.gateway_listen,
            "--flush-seconds", f"{o.flush_s:g}"]


def _export(o: ServeOptions, c: Config) -> list[str] | None:
    if o.export_port is None:
        return None
    return ["export", "--db", o.db, "--port", str(o.export_port), "--host", o.host]


def _dashboard(o: ServeOptions, c: Config) -> list[str] | None:
    if not o.dashboard:
        return None
    return ["dashboard", "--db", o.db, "--port", str(o.dashboard_port), "--host", o.host]


CHILDREN: tuple[ChildSpec, ...] = (
    ChildSpec("collect-vllm", _collect_vllm),
    ChildSpec("scrape", _scrape),
    ChildSpec("otlp", _otlp),
    ChildSpec("gateway", _gateway),
    ChildSpec("export", _export, needs_db=True),
    ChildSpec("dashboard", _dashboard, needs_db=True),
)


class ServeMetrics:
    """serve's own Prometheus metrics (every value measured by serve itself)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "kvlens_serve_"
        self.restarts = Counter(p + "child_restarts", "Children restarted after they exited", ["child"],
                                registry=r)
        self.exit_status = Gauge(p + "child_last_exit_status", "Exit status of each child's last exit "
                                 "(128+N: killed by signal N)", ["child"], registry=r)
        self.up = Gauge(p + "child_up", "1 while the child runs", ["child"], registry=r)
        self.analyses = Counter(p + "analyses", "kvlens analyze runs finished, by result (ok, failed, "
                                "over_memory_limit: stopped at --analyze-memory-limit)", ["result"],
                                registry=r)
        self.duration = Gauge(p + "last_analysis_duration_seconds", "Wall time of the last finished analysis",
                              registry=r)
        self.finished = Gauge(p + "last_analysis_end_timestamp_seconds", "When the last good analysis ended",
                              registry=r)
        self.peak = Gauge(p + "last_analysis_peak_rss_bytes", "Peak resident memory of the last finished "
                          "analysis (its VmHWM, read every tick while it ran)", registry=r)

    def value(self, name: str, **labels: str) -> float:
        v = self.registry.get_sample_value(name, labels or None)
        return 0.0 if v is None else v


@dataclass
class _Restart:
    failures: int = 0
    due: float = 0.0
    started: float = 0.0


class Serving:
    """The serve loop: ``run`` until ``stop()`` (a signal handler may call it), then every child stops."""

    def __init__(self, options: ServeOptions, *, specs: tuple[ChildSpec, ...] = CHILDREN) -> None:
        self.opt = options
        self.config = load_config(options.config)
        self.metrics = ServeMetrics()
        self.sup = Supervisor(grace_s=options.grace_s)
        self._stop = threading.Event()
        self.daemons = {s.name: (s, argv) for s in specs
                        if (argv := s.argv(options, self.config)) is not None}
        self._state = {name: _Restart() for name in self.daemons}
        self._analysis_started = 0.0
        self._analysis_peak = 0  # bytes: the running analysis's VmHWM as last read
        self._next_analysis = self._first_analysis()

    def stop(self) -> None:
        self._stop.set()

    def _first_analysis(self) -> float:
        """Now when the DB is missing or older than a period (a killed serve's unfinished period),
        else when it falls due."""
        db = Path(self.opt.db)
        if not db.exists():
            return time.monotonic()
        age = max(0.0, time.time() - db.stat().st_mtime)
        return time.monotonic() + max(0.0, self.opt.analyze_every_s - age)

    def _cmd(self, args: list[str]) -> list[str]:
        return [*self.opt.kvlens, *args]

    def run(self) -> dict[str, int]:
        """Supervise until stopped; the children's exit statuses at the stop."""
        Path(self.opt.lake).mkdir(parents=True, exist_ok=True)
        try:
            while not self._stop.is_set():
                self._tick()
                self._stop.wait(0.1)
        finally:
            statuses = self.sup.stop_all()
            for name in statuses:
                self.metrics.up.labels(child=name).set(0)
        return statuses

    def _tick(self) -> None:
        now = time.monotonic()
        for name, status in self.sup.reap():
            self.metrics.up.labels(child=name).set(0)
            if name == ANALYZE:
                self._analysis_done(status, now)
            else:
                self._exited(name, status, now)
        db_ready = Path(self.opt.db).is_file()
        for name, (spec, argv) in self.daemons.items():
            st = self._state[name]
            if self.sup.running(name) or now < st.due or (spec.needs_db and not db_ready):
                continue
            self.sup.start(name, self._cmd(argv))
            st.started = now
            self.metrics.up.labels(child=name).set(1)
            log.info("started %s", name)
        if not self.sup.running(ANALYZE) and now >= self._next_analysis:
            self.sup.start(ANALYZE, self._cmd(analyze_args(self.opt)))
            self._analysis_started = now
            self._analysis_peak = 0
            self.metrics.up.labels(child=ANALYZE).set(1)
        analysis = self.sup.children.get(ANALYZE)
        if analysis is not None:  # its high-water mark so far (what --analyze-memory-limit compares with)
            self._analysis_peak = max(self._analysis_peak, peak_resident_bytes(analysis.pid) or 0)

    def _exited(self, name: str, status: int, now: float) -> None:
        st = self._state[name]
        if now - st.started >= self.opt.backoff_cap_s:
            st.failures = 0  # it ran long enough: this is a fresh failure, not one in a row
        st.failures += 1
        delay = min(self.opt.backoff_cap_s, self.opt.backoff_s * 2 ** (st.failures - 1))
        st.due = now + delay
        self.metrics.restarts.labels(child=name).inc()
        self.metrics.exit_status.labels(child=name).set(status)
        log.warning("%s exited with status %d; restarting it in %.1f s", name, status, delay)

    def _analysis_done(self, status: int, now: float) -> None:
        self.metrics.exit_status.labels(child=ANALYZE).set(status)
        over = status == MEMORY_EXIT and self.opt.analyze_memory_limit is not None
        self.metrics.analyses.labels(result="ok" if status == 0 else "over_memory_limit" if over
                                     else "failed").inc()
        self.metrics.duration.set(now - self._analysis_started)
        if self._analysis_peak:
            self.metrics.peak.set(self._analysis_peak)
        if status == 0:
            self.metrics.finished.set(time.time())
        elif over:
            log.warning("kvlens analyze stopped at --analyze-memory-limit %s; the previous analysis DB "
                        "stays: raise the limit (its stderr above says how far it got)",
                        format_bytes(self.opt.analyze_memory_limit or 0))
        else:
            log.warning("kvlens analyze exited with status %d; the previous analysis DB stays", status)
        self._next_analysis = max(now, self._analysis_started + self.opt.analyze_every_s)


def check_ports(o: ServeOptions, otlp: tuple[str, int] | None, config: Config | None = None) -> None:
    """A ConfigError now for a port serve's children could not bind, instead of a restart loop;
    ``otlp``: ``--otlp-listen`` as (host, port); ``config``: the fleet, whose gateway (when it has one)
    binds ``--gateway-listen``."""
    from kvlens.supervise import check_port_free, parse_listen

    if otlp is not None:
        check_port_free(*otlp, "--otlp-listen")
    if o.gateway_listen and config is not None and _gateway_configured(config):
        try:
            gateway = parse_listen(o.gateway_listen)
        except ConfigError:
            raise ConfigError(f"--gateway-listen {o.gateway_listen!r} is not HOST:PORT: give e.g. "
                              "127.0.0.1:8000, or off") from None
        check_port_free(*gateway, "--gateway-listen")
    if o.export_port is not None:
        check_port_free(o.host, o.export_port, "--export-port")
    if o.dashboard:
        check_port_free(o.host, o.dashboard_port, "--dashboard-port")
    if o.metrics_port is not None:
        check_port_free(o.host, o.metrics_port, "--metrics-port")


def serve_metrics(serving: Serving, host: str, port: int) -> Any:
    """Start serve's own /metrics on a thread; the server (``shutdown``/``server_close`` to stop it)."""
    from prometheus_client import start_http_server

    server, _ = start_http_server(port, addr=host, registry=serving.metrics.registry)
    return server


def run_serve(options: ServeOptions, *, otlp_address: tuple[str, int] | None, until: StopScope | None = None,
              announce: Callable[[str], object] = lambda _line: None) -> dict[str, int]:
    """Check the ports, serve /metrics, supervise until ``until``'s stop; the children's exit statuses
    at the stop. ``otlp_address``: ``options.otlp_listen`` parsed (``serve_fleet`` parses it)."""
    check_ports(options, otlp_address, load_config(options.config))
    serving = Serving(options)
    o = options
    server = serve_metrics(serving, o.host, o.metrics_port) if o.metrics_port is not None else None
    where = f"; /metrics on http://{o.host}:{o.metrics_port}/metrics" if server else ""
    announce(f"serving {o.config}: {', '.join(serving.daemons) or 'no children'}, analyze every "
             f"{o.analyze_every_s:g} s{where}")
    try:
        with stop_scope(until, serving.stop):
            return serving.run()
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()


def serve_fleet(config: str, lake: str, db: str, *, otlp_listen: str = "127.0.0.1:4318",
                gateway_listen: str = "127.0.0.1:8000", export_port: int = 9465, no_export: bool = False,
                until: StopScope | None = None, announce: Callable[[str], object] = lambda _line: None,
                **knobs: Any) -> dict[str, int]:
    """``kvlens serve``'s front door: its flags as given ('off' runs no OTLP receiver or gateway;
    ``knobs``: the other ServeOptions fields), run by ``run_serve``; the children's exit statuses."""
    otlp = None if otlp_listen == "off" else otlp_listen
    options = ServeOptions(config=config, lake=lake, db=db, otlp_listen=otlp,
                           gateway_listen=None if gateway_listen == "off" else gateway_listen,
                           export_port=None if no_export else export_port, **knobs)
    return run_serve(options, otlp_address=parse_listen(otlp) if otlp else None, until=until,
                     announce=announce)
