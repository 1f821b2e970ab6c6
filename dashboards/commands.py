"""Dashboards' front doors for ``kvlens report``, ``export``, ``dashboard``: an analysis DB -> operators."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlens.analysis_db import check_duckdb_file
from kvlens.config import SmtpConfig, load_config, merge_flags
from kvlens.errors import ConfigError
from kvlens.supervise import StopScope, check_port_free, run_child, stop_scope

__all__ = ["MAIL_FLAGS", "ReportResult", "run_dashboard", "run_export", "run_report"]

# The email settings of kvlens report, by flag name; the toml's [smtp] gives any the flags do not.
MAIL_FLAGS = ("email_to", "smtp", "starttls", "user", "password_env", "sender", "subject")
MAIL_DEFAULTS = {"sender": "kvlens@localhost", "starttls": False}


@dataclass(frozen=True)
class ReportResult:
    """The page written (its size, its charts) and to whom it was sent through which server, if sent."""

    path: Path
    size_bytes: int
    charts: int
    recipients: tuple[str, ...] = ()
    smtp: str | None = None


def _file_flags(smtp: SmtpConfig | None) -> dict[str, Any]:
    """The toml's [smtp] under the flags' names."""
    if smtp is None:
        return {}
    return {"smtp": smtp.server, "email_to": ",".join(smtp.to) if smtp.to else None,
            "starttls": smtp.starttls, "user": smtp.user, "password_env": smtp.password_env,
            "sender": smtp.sender}


def _smtp_settings(mail: Mapping[str, Any], environ: Mapping[str, str]) -> Any:
    from kvlens.dashboards.report.mail import SmtpSettings, parse_smtp

    user, password_env = mail["user"], mail["password_env"]
    if (user is None) != (password_env is None):
        raise ConfigError("--user and --password-env go together: the password is read from the "
                          "environment variable --password-env names, never from the command line")
    password = None
    if password_env is not None:
        password = environ.get(password_env)
        if password is None:
            raise ConfigError(f"environment variable {password_env} (from --password-env) is not set: "
                              "export it with the SMTP password")
    host, port = parse_smtp(mail["smtp"])
    return SmtpSettings(host=host, port=port, starttls=bool(mail["starttls"]), user=user, password=password)


def run_report(db: str | Path, out: str | Path, *, since: str = "24h",
               now_ns: int | None = None, scenarios: Sequence[str] = (),
               mail: Mapping[str, Any] | None = None, config: str | Path | None = None,
               environ: Mapping[str, str] = os.environ, gpu_hour_price: float | None = None,
               production: str | None = None) -> ReportResult:
    """Write the report on ``db`` to ``out``; email it when ``mail`` (MAIL_FLAGS, flags over
    ``config``'s [smtp]) names recipients and a server. The password comes from ``environ``; the
    GPU-hour price from ``gpu_hour_price``, else ``config``'s [costs] gpu_hour_usd."""
    from kvlens.dashboards.report import build_report, parse_duration_ns, save_html

    loaded = load_config(config) if config else None
    file = _file_flags(loaded.smtp) if loaded else {}
    if gpu_hour_price is None and loaded is not None:
        gpu_hour_price = loaded.gpu_hour_usd
    merged = merge_flags({k: (mail or {}).get(k) for k in MAIL_FLAGS}, file, MAIL_DEFAULTS,
                         together=(("user", "password_env"),))
    if (merged["email_to"] is None) != (merged["smtp"] is None):
        raise ConfigError("--email-to and --smtp go together (or to and server in the --config file's "
                          "[smtp]): give both to send the report, or neither")
    settings = _smtp_settings(merged, environ) if merged["smtp"] else None
    report = build_report(db, since_ns=parse_duration_ns(since), now_ns=now_ns,
                          scenarios=list(scenarios) or None, usd_per_gpu_hour=gpu_hour_price,
                          production=production)
    path = save_html(report, out)
    result = ReportResult(path, path.stat().st_size, len(report.charts))
    if settings is None or merged["email_to"] is None:
        return result
    from kvlens.dashboards.report.mail import build_message, send_message

    recipients = tuple(a.strip() for a in merged["email_to"].split(",") if a.strip())
    send_message(build_message(report, sender=merged["sender"], recipients=recipients,
                               subject=merged["subject"]), settings)
    return ReportResult(path, result.size_bytes, result.charts, recipients, merged["smtp"])


def run_export(db: str | Path, *, port: int, host: str = "127.0.0.1", top_prefixes: int = 10,
               duration_s: float | None = None, until: StopScope | None = None,
               announce: Callable[[str], object] = lambda _line: None) -> None:
    """Serve ``db``'s ledger as Prometheus gauges on ``host:port`` until ``duration_s`` passes or
    ``until``'s scope calls stop; the server is shut and its socket closed on the way out."""
    from kvlens.dashboards.export import serve

    check_duckdb_file(db)
    check_port_free(host, port, "--port")
    server, _, bound = serve(db, port=port, host=host, top_prefixes=top_prefixes)
    stop = threading.Event()
    announce(f"serving {db} on http://{host}:{bound}/metrics")
    try:
        with stop_scope(until, stop.set):
            stop.wait(duration_s)
    finally:
        server.shutdown()
        server.server_close()


def run_dashboard(db: str | Path, *, port: int = 8501, host: str = "127.0.0.1",
                  announce: Callable[[str], object] = lambda _line: None,
                  gpu_hour_price: float | None = None) -> int:
    """Serve the Streamlit dashboard over ``db`` as a child that dies with this process; its exit status.

    A SIGTERM, SIGINT or SIGHUP here is passed on and waited for, and a SIGKILL here ends it too
    (kvlens/supervise.py).
    """
    if importlib.util.find_spec("streamlit") is None:
        raise ConfigError("the dashboard needs streamlit: pip install 'kvlens[dashboard]'")
    path = check_duckdb_file(db)
    check_port_free(host, port, "--port")
    app = Path(__file__).resolve().parent / "app.py"
    cmd = [sys.executable, "-m", "streamlit", "run", str(app), "--server.headless=true",
           "--browser.gatherUsageStats=false", "--server.fileWatcherType=none", "--server.runOnSave=false",
           f"--server.port={port}", f"--server.address={host}", "--", "--db", str(path.resolve())]
    env = None
    if gpu_hour_price is not None:  # the overview reads it (dashboards/pages/overview.py)
        env = {**os.environ, "KVLENS_GPU_HOUR_USD": repr(gpu_hour_price)}
    announce(f"kvlens dashboard on http://{host}:{port}/ (Ctrl-C stops it)")
    return run_child(cmd, env=env)
