"""The spine's memory limit: ``kvlens analyze --memory-limit`` (and ``kvlens serve
--analyze-memory-limit``, which gives it to every periodic analysis).

An analysis holds a scenario's block accesses in memory (frames, the replay's arrays, the saved
states), so a lake's age or a busy day can grow it past what the machine has. Where the host also
runs the collectors (``kvlens serve``), the kernel's OOM killer may then pick a collector, or a
container's whole process tree. With a limit the analysis stops itself first:

- DuckDB is given half of it (its ``memory_limit``: past it, its sorts and joins spill to the
  directory beside the DB being built, kvlens/analysis_db.py);
- a watchdog thread reads this process's resident memory (``/proc/self/statm``) every
  ``EVERY_S``. Past the limit it marks the guard stopped, and the next safe point (``check``:
  kvlens/analysis_db.py asks after each table it writes, and before it commits the file) raises
  ``MemoryLimitError``. The analysis DB is written under a temporary name and renamed into place
  only when it is complete, so the previous one is left as it was. The stop is not raised from a
  signal handler into whatever runs: an exception that lands inside a compiled call's return (a
  numba kernel boxing its result tuple) crashed the process here (a segmentation fault, every
  time, on the whole sample trace with a 750 MiB limit);
- past ``HARD_FACTOR`` times the limit, or ``GRACE_S`` after the stop with no safe point reached
  (one long step, such as the ledger's replay of a large scenario), the watchdog writes the same
  message to stderr and ends the process with status ``MEMORY_EXIT``; the temporary DB left
  behind is removed by the next build (``remove_dead_leftovers``), as after a ``kill -9``.

The limit bounds this process. Ray's workers (``--ray``) are bounded by Ray's own memory monitor.
It stops an analysis that needs more; it does not make one fit: analyzing a lake larger than
memory needs issue 17's out-of-core analyses (docs/scale.md).
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from pathlib import Path
from types import TracebackType

from kvlens.errors import MEMORY_EXIT, ConfigError, MemoryLimitError

__all__ = ["ANALYSIS_HINT", "EVERY_S", "GRACE_S", "HARD_FACTOR", "MemoryGuard", "check", "format_bytes",
           "parse_size", "peak_resident_bytes", "resident_bytes"]

EVERY_S = 0.02  # how often the watchdog reads the resident memory (a read of /proc/self/statm)
GRACE_S = 10.0  # from the stop to the end of the process, when no safe point was reached
HARD_FACTOR = 1.5  # resident memory, in limits, at which the process ends without waiting
_STATM = "/proc/self/statm"
_PAGE = os.sysconf("SC_PAGE_SIZE")
# Units as Kubernetes' quantities and DuckDB's memory_limit read them: k, M, G, T (optionally with
# B) are powers of 1000; Ki, Mi, Gi, Ti (optionally with B) powers of 1024; none or B are bytes.
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(i)?)?b?", re.IGNORECASE)
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4}
# What an analysis stopped at its limit left (kvlens/analysis_db.py renames a complete DB into place
# only), and what to do.
ANALYSIS_HINT = ("the previous analysis DB is unchanged; raise the limit, or analyze fewer scenarios at a "
                 "time (--scenario)")


def parse_size(text: str, flag: str = "--memory-limit") -> int:
    """Bytes from ``4GiB``, ``512Mi``, ``1.5G``, ``2000000000``; ConfigError naming ``flag`` when
    ``text`` is not a positive size."""
    got = _SIZE.fullmatch(text.strip())
    if got is None:
        raise ConfigError(f"{flag} {text!r} is not a size: give e.g. 4GiB, 512MiB or 2G (G = 10^9 bytes, "
                          "Gi = 2^30)")
    number, unit, binary = got.groups()
    value = float(number) * ((1024 if binary else 1000) ** _POWERS[unit.lower()] if unit else 1)
    if value < 1:
        raise ConfigError(f"{flag} {text!r} is not a positive size: give e.g. 4GiB")
    return int(value)


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units, as an operator reads them: 512 MiB, 4.0 GiB."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            value = n / (1 << shift)
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{int(n)} B"


def resident_bytes() -> int:
    """This process's resident memory now (``/proc/self/statm``: resident pages)."""
    with open(_STATM, "rb") as f:
        return int(f.read().split()[1]) * _PAGE


def peak_resident_bytes(pid: int | str = "self") -> int | None:
    """The most resident memory process ``pid`` (default: this one) has held so far (``VmHWM`` of
    ``/proc/PID/status``); None where there is no such file (not Linux, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


_ACTIVE: list[MemoryGuard] = []  # the guards this process keeps now (``check``)


def check() -> None:
    """A safe point: MemoryLimitError when a guard this process keeps was passed."""
    for guard in _ACTIVE:
        guard.check()


class MemoryGuard:
    """While inside, the process stops itself once its resident memory passes ``limit`` bytes:
    ``MemoryLimitError`` at the next safe point (``check``), and the end of the process past
    ``hard`` times the limit or ``grace_s`` after the stop (this module's docstring). ``flag``: what
    the message names as the limit, and ``hint`` what the stop left and what to do; ``peak``: the
    most resident memory seen."""

    def __init__(self, limit: int, *, flag: str = "--memory-limit", hint: str = ANALYSIS_HINT,
                 every_s: float = EVERY_S, grace_s: float = GRACE_S, hard: float = HARD_FACTOR) -> None:
        if limit < 1:
            raise ValueError(f"limit must be a positive number of bytes, got {limit}")
        self.limit, self.flag, self.hint, self.every_s, self.grace_s = limit, flag, hint, every_s, grace_s
        self.hard_limit = int(limit * hard)
        self.peak = 0
        self.stopped_at: int | None = None  # the resident memory that stopped it
        self._since = 0.0
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def message(self) -> str:
        return (f"resident memory reached {format_bytes(self.stopped_at or self.peak)}, over {self.flag} "
                f"{format_bytes(self.limit)} (measured every {self.every_s * 1e3:.0f} ms): stopped before "
                f"it finished; {self.hint}")

    def check(self) -> None:
        """MemoryLimitError once the limit was passed."""
        if self.stopped_at is not None:
            raise MemoryLimitError(self.message())

    def __enter__(self) -> MemoryGuard:
        if not Path(_STATM).exists():
            raise ConfigError(f"{self.flag} reads the resident memory from {_STATM}, which this system "
                              f"does not have (Linux has it): run without {self.flag}")
        self.peak = resident_bytes()
        self._done.clear()
        self._thread = threading.Thread(target=self._watch, name="kvlens memory limit", daemon=True)
        self._thread.start()
        _ACTIVE.append(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        _ACTIVE.remove(self)
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        while not self._done.wait(self.every_s):
            rss = resident_bytes()
            self.peak = max(self.peak, rss)
            if self.stopped_at is None:
                if rss > self.limit:
                    self.stopped_at, self._since = rss, time.monotonic()
            elif rss > self.hard_limit or time.monotonic() - self._since > self.grace_s:
                self._end(rss)

    def _end(self, rss: int) -> None:
        why = (f"it reached {format_bytes(rss)}" if rss > self.hard_limit
               else f"no safe point came within {self.grace_s:g} s")
        text = f"Error: {self.message()}; ended: {why}\n"
        try:
            sys.stderr.flush()
            os.write(2, text.encode())
        finally:
            os._exit(MEMORY_EXIT)
