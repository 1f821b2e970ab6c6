"""The spine's supervisor: child processes that die with this one (the dashboard, ``kvlens serve``).

``run_child`` starts the child in its own process group and

- forwards SIGTERM, SIGINT and SIGHUP sent to this process to the child's group, then waits for it
  (``grace_s``, then SIGKILL): a stopped supervisor leaves no child and no bound port;
- asks Linux to send the child SIGTERM when this process dies, however it dies (SIGKILL
  included): ``prctl(PR_SET_PDEATHSIG)`` (prctl(2)) set in the child between fork and exec, and
  the child ends itself at once if its parent was already gone by then.

``Supervisor`` holds several such children by name (``kvlens serve``'s tree): each in its own
process group with the same death signal; ``reap`` says which exited and how; ``stop_all``
sends SIGTERM to every group at once, waits ``grace_s`` for all of them, then SIGKILLs the rest.

PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, so call ``run_child`` from
the main thread (signal handlers can only be installed there anyway). On other systems the
forwarding still works; a SIGKILLed supervisor there orphans its child.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from types import FrameType

from kvlens.errors import ConfigError

__all__ = ["FORWARDED", "StopScope", "Supervisor", "check_port_free", "exit_status", "parse_listen",
           "run_child", "stop_scope"]

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# A long-running front door (a collector, the exporter) hands its stop callable to a StopScope and
# runs its loop inside: the CLI's scope turns SIGTERM/SIGINT into that call (kvlens/cli_kit.py),
# a library caller may pass none (the loop ends at its duration) or its own.
StopScope = Callable[[Callable[[], object]], AbstractContextManager[object]]


def stop_scope(scope: StopScope | None, stop: Callable[[], object]) -> AbstractContextManager[object]:
    """``scope(stop)``, or a scope that never calls ``stop`` when ``scope`` is None."""
    return scope(stop) if scope is not None else contextlib.nullcontext()


def _die_with(parent: int, sig: int) -> Callable[[], None] | None:
    """The child's preexec: PDEATHSIG, then a check that the parent did not die before it was set."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before the fork

    def preexec() -> None:
        if prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            os._exit(126)
        if os.getppid() != parent:  # orphaned already: the signal will never come
            os.kill(os.getpid(), sig)

    return preexec


def exit_status(returncode: int) -> int:
    """A shell-style exit status: 128 + N for a child killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


_status = exit_status


def _spawn(cmd: Sequence[str], env: Mapping[str, str] | None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(list(cmd), env=None if env is None else dict(env),
                            preexec_fn=_die_with(os.getpid(), signal.SIGTERM), process_group=0)


class Supervisor:
    """Named children, each in its own process group, each dying with this process (module docstring).

    Call it from the main thread (PR_SET_PDEATHSIG follows the forking thread).
    """

    def __init__(self, grace_s: float = 10.0) -> None:
        self.grace_s = grace_s
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, cmd: Sequence[str], env: Mapping[str, str] | None = None) -> int:
        """Start ``cmd`` as child ``name`` (which must not be running); its pid."""
        if name in self.children:
            raise RuntimeError(f"child {name} is already running")
        proc = self.children[name] = _spawn(cmd, env)
        return proc.pid

    def running(self, name: str) -> bool:
        return name in self.children

    def reap(self) -> list[tuple[str, int]]:
        """(name, exit status) of every child that has exited since the last call; they are forgotten."""
        done = [(name, proc) for name, proc in self.children.items() if proc.poll() is not None]
        for name, _ in done:
            del self.children[name]
        return [(name, exit_status(proc.returncode)) for name, proc in done]

    def stop(self, name: str) -> int | None:
        """Stop one child (SIGTERM to its group, SIGKILL after ``grace_s``); its exit status, or
        None when it was not running."""
        proc = self.children.pop(name, None)
        if proc is None:
            return None
        _signal_group(proc, signal.SIGTERM)
        return exit_status(_wait(proc, [signal.SIGTERM], self.grace_s))

    def stop_all(self) -> dict[str, int]:
        """SIGTERM every child's group at once, wait up to ``grace_s`` for all, SIGKILL what remains."""
        procs, self.children = self.children, {}
        for proc in procs.values():
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        out = {}
        for name, proc in procs.items():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
            _signal_group(proc, signal.SIGKILL)  # whatever the child left in its group
            out[name] = exit_status(proc.returncode)
        return out


def run_child(cmd: Sequence[str], *, grace_s: float = 10.0, env: Mapping[str, str] | None = None,
              on_start: Callable[[subprocess.Popen[bytes]], None] | None = None) -> int:
    """Run ``cmd`` until it exits, tied to this process (module docstring); its exit status.

    A child that stops because a forwarded signal asked it to counts as a clean stop: 0.
    """
    asked: list[int] = []
    proc: subprocess.Popen[bytes] | None = None

    def forward(signum: int, _frame: FrameType | None) -> None:
        asked.append(signum)
        if proc is not None:
            _signal_group(proc, signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        proc = _spawn(cmd, env)
        if asked:  # a signal came while the child was starting
            _signal_group(proc, asked[-1])
        if on_start is not None:
            on_start(proc)
        returncode = _wait(proc, asked, grace_s)
    finally:
        if proc is not None and proc.poll() is None:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if asked and returncode in (0, -asked[0], 128 + asked[0]):
        return 0
    return _status(returncode)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(proc.pid, sig)


def _wait(proc: subprocess.Popen[bytes], asked: list[int], grace_s: float) -> int:
    """Wait for the child; once a stop was forwarded, give it ``grace_s`` before SIGKILL."""
    deadline: float | None = None
    while True:
        try:
            return proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        if asked and deadline is None:
            deadline = time.monotonic() + grace_s
        if deadline is not None and time.monotonic() >= deadline:
            _signal_group(proc, signal.SIGKILL)
            return proc.wait()


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as (host, port)."""
    m = re.fullmatch(r"\[(?P<v6>[^\]]+)\]:(?P<p>\d+)|(?P<h>[^:\[\]]+):(?P<port>\d+)", text.strip())
    port = int(m.group("p") or m.group("port")) if m else -1
    if not m or not 0 <= port <= 65535:
        raise ConfigError(f"--listen {text!r} is not HOST:PORT: give e.g. 127.0.0.1:4318 or [::1]:4318")
    return m.group("v6") or m.group("h"), port


def check_port_free(host: str, port: int, flag: str) -> None:
    """A ConfigError naming ``flag`` when ``host:port`` cannot be bound (in use, or not an address here)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"{flag}: cannot resolve {host!r} ({e.strerror}): give an address of this "
                          "machine, e.g. 127.0.0.1 or 0.0.0.0") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            what = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
            raise ConfigError(f"{flag}: {host}:{port} {what}: stop what holds it, or choose another "
                              "port") from None
