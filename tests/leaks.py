"""Tests: what a test leaves behind (sockets, pipes, child processes, threads), found at its own teardown.

A socket a test forgets is closed by the garbage collector whenever a collection happens to run,
usually in a later test, whose ResourceWarning then fails that innocent test. ``Leaks.check``
runs at the end of every test (tests/conftest.py): it compares the process's open sockets and
pipes (``/proc/self/fd``), its children (``/proc/self/task/*/children``) and its threads with
what was there before the test; while something new remains it collects garbage (recording the
ResourceWarnings that raises) and waits, up to a deadline, for sockets that a peer or a library's
I/O thread is still closing. Whatever remains, and every ResourceWarning recorded, is a leak of
THIS test.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Leaks"]

_PROC = Path("/proc/self")


def _fds() -> set[tuple[int, str]]:
    """(fd, 'socket:[inode]' or 'pipe:[inode]') for every open socket and pipe of this process."""
    found = set()
    for entry in os.scandir(_PROC / "fd"):
        try:
            target = os.readlink(entry.path)
        except OSError:  # closed while we looked (the scandir's own fd among them)
            continue
        if target.startswith(("socket:", "pipe:")):
            found.add((int(entry.name), target))
    return found


def _children() -> set[int]:
    pids: set[int] = set()
    for task in (_PROC / "task").iterdir():
        try:
            pids.update(int(p) for p in (task / "children").read_text().split())
        except OSError:  # a thread that ended while we looked
            continue
    return pids


def _describe_child(pid: int) -> str:
    try:
        cmd = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return f"pid {pid} (gone)"
    return f"pid {pid} [{'zombie: never waited for' if state == 'Z' else 'running'}] {cmd.strip()}"


def _tcp_ports() -> dict[str, str]:
    """socket inode -> 'local -> remote' for TCP sockets (for messages only)."""
    out = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = (Path("/proc/net") / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            local, remote, inode = cols[1], cols[2], cols[9]
            out[inode] = f"port {int(local.split(':')[1], 16)} -> {int(remote.split(':')[1], 16)}"
    return out


@dataclass
class Leaks:
    """A snapshot before a test; ``check()`` after it lists what the test left behind."""

    fds: set[tuple[int, str]] = field(default_factory=_fds)
    children: set[int] = field(default_factory=_children)
    threads: set[threading.Thread] = field(default_factory=lambda: set(threading.enumerate()))

    def _remaining(self) -> tuple[set[tuple[int, str]], set[int], set[threading.Thread]]:
        return (_fds() - self.fds, _children() - self.children,
                {t for t in threading.enumerate() if t not in self.threads and t.is_alive()})

    def check(self, deadline_s: float = 10.0) -> list[str]:
        """What this test leaked, in words; empty when nothing."""
        recorded: list[warnings.WarningMessage] = []
        deadline = time.monotonic() + deadline_s
        fds, children, threads = self._remaining()
        while (fds or children or threads) and time.monotonic() < deadline:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", ResourceWarning)
                gc.collect()
            recorded += [w for w in caught if issubclass(w.category, ResourceWarning)]
            for t in threads:
                t.join(0.05)
            time.sleep(0.02)  # a peer or an I/O thread closing its end: poll until the deadline
            fds, children, threads = self._remaining()
        ports = _tcp_ports() if fds else {}
        found = [f"unclosed {target} ({ports.get(target[8:-1], 'not TCP')}) on fd {fd}"
                 for fd, target in sorted(fds)]
        found += [f"child process {_describe_child(pid)}" for pid in sorted(children)]
        found += [f"thread {t.name!r} still running" for t in sorted(threads, key=lambda t: t.name)]
        found += [f"{w.message} (closed by the garbage collector, not by the test)" for w in recorded]
        return found

    def reap(self) -> None:
        """Kill and wait for the children this test left (so they cannot disturb the next test)."""
        for pid in _children() - self.children:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                continue
