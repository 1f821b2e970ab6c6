"""A supervised child dies with its supervisor (kvlens/supervise.py), and so does the dashboard's Streamlit.

Real processes throughout: a supervisor process running ``run_child`` (or ``kvlens dashboard``),
its child holding a listening port; the supervisor is stopped with SIGTERM or SIGINT, or killed
with SIGKILL, and afterwards no child is left and the port is free.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvlens.errors import ConfigError
from kvlens.supervise import check_port_free

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 120.0  # only bounds a failure: each wait ends as soon as its condition holds

# The child: listens on a port, says so, and waits for a signal (default actions: it dies).
_CHILD = """
import signal, socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen()
print("listening", flush=True)
signal.pause()
"""
# The supervisor: runs the child under run_child and prints its pid first.
_SUPERVISOR = """
import sys
from kvlens.supervise import run_child
rc = run_child([sys.executable, "-c", sys.argv[1], sys.argv[2]],
               on_start=lambda p: print(f"child {p.pid}", flush=True))
print(f"exit {rc}", flush=True)
sys.exit(rc)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.05)


def _readline(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], DEADLINE_S)
    assert ready, "no line from the supervisor in time"
    return proc.stdout.readline().strip()


def _gone(pid: int) -> bool:
    """No such process, or a zombie (dead, waiting for init to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _port_free(port: int) -> bool:
    try:
        check_port_free("127.0.0.1", port, "--port")
    except ConfigError:
        return False
    return True


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _spawn(args: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)


def _supervised(port: int) -> tuple[subprocess.Popen[str], int]:
    sup = _spawn([sys.executable, "-c", _SUPERVISOR, _CHILD, str(port)])
    line = _readline(sup)
    assert line.startswith("child "), line
    child = int(line.split()[1])
    _wait(lambda: _accepts(port), f"the child listens on {port}")
    return sup, child


def _finish(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stopped_supervisor_stops_its_child_and_frees_the_port(sig: signal.Signals) -> None:
    port = _free_port()
    sup, child = _supervised(port)
    try:
        sup.send_signal(sig)
        assert sup.wait(DEADLINE_S) == 0  # the child stopped because it was asked: a clean stop
        assert _gone(child)
        assert _port_free(port)
    finally:
        _finish(sup)


def test_a_killed_supervisor_takes_its_child_down() -> None:
    port = _free_port()
    sup, child = _supervised(port)
    try:
        sup.send_signal(signal.SIGKILL)
        sup.wait(DEADLINE_S)
        _wait(lambda: _gone(child), f"child {child} is gone")
        _wait(lambda: _port_free(port), f"port {port} is free")
    finally:
        _finish(sup)


def test_a_child_that_ignores_the_stop_is_killed_after_the_grace() -> None:
    code = ("import signal, sys; from kvlens.supervise import run_child; "
            "sys.exit(run_child([sys.executable, '-c', 'import signal; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); signal.pause()'], "
            "grace_s=0.5, on_start=lambda p: print(f'child {p.pid}', flush=True)))")
    sup = _spawn([sys.executable, "-c", code])
    try:
        child = int(_readline(sup).split()[1])
        assert _readline(sup) == "1"  # the child is up, its SIGTERM ignored
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(DEADLINE_S) == 128 + signal.SIGKILL
        assert _gone(child)
    finally:
        _finish(sup)


def test_the_childs_own_exit_status_comes_back() -> None:
    from kvlens.supervise import run_child

    assert run_child([sys.executable, "-c", "raise SystemExit(3)"]) == 3
    assert run_child([sys.executable, "-c", "pass"]) == 0


# -- kvlens dashboard --------------------------------------------------------------------------


def _dashboard(db: Path, port: int) -> tuple[subprocess.Popen[str], int]:
    dash = _spawn([sys.executable, "-m", "kvlens.cli", "dashboard", "--db", str(db), "--port", str(port)])
    _wait(lambda: _accepts(port), f"the dashboard serves on {port}")
    (streamlit,) = _children(dash.pid)
    return dash, streamlit


@pytest.fixture
def tiny_db(tmp_path: Path) -> Path:
    from tiny_analysis_db import make_tiny_db

    path = tmp_path / "tiny.duckdb"
    make_tiny_db(path)
    return path


def test_sigterm_to_the_dashboard_leaves_no_streamlit_and_frees_the_port(tiny_db: Path) -> None:
    port = _free_port()
    dash, streamlit = _dashboard(tiny_db, port)
    try:
        dash.send_signal(signal.SIGTERM)
        assert dash.wait(DEADLINE_S) == 0
        assert _gone(streamlit)
        assert _port_free(port)
    finally:
        _finish(dash)


def test_sigkill_of_the_dashboard_takes_streamlit_down(tiny_db: Path) -> None:
    port = _free_port()
    dash, streamlit = _dashboard(tiny_db, port)
    try:
        dash.send_signal(signal.SIGKILL)
        dash.wait(DEADLINE_S)
        _wait(lambda: _gone(streamlit), f"Streamlit {streamlit} is gone")
        _wait(lambda: _port_free(port), f"port {port} is free")
    finally:
        _finish(dash)
