"""The spine's command-line kit: the one-line-error group, progress bars, the signal scope and the
parse helpers of cli.py (its option stacks are in cli_options.py).

Only the spine is imported here (the architecture test lets kvlens/cli.py alone reach the other
packages, lazily), so what needs a package's registry stays in cli.py.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import click

from kvlens.errors import MEMORY_EXIT, ConfigError, InputError, KvlensError

__all__ = ["Group", "LazyChoice", "given_model", "items_bar", "model_name", "own_the_process", "parse_now",
           "parse_token_ids", "progress_bar", "stopped_by_signals"]


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def _usage_error(e: click.UsageError) -> click.ClickException:
    """A usage error as one ``Error:`` line that says where and points at --help (exit 1)."""
    where = e.ctx.command_path if e.ctx is not None else "kvlens"
    if isinstance(e, click.exceptions.NoArgsIsHelpError) and isinstance(e.ctx.command, click.Group):
        names = ", ".join(e.ctx.command.list_commands(e.ctx))
        return click.ClickException(f"{where} needs a command ({names}): see {where} --help")
    return click.ClickException(f"{_one_line(e.format_message())} (see {where} --help)")


class _StoppedAtLimit(click.ClickException):
    """A command stopped at its --memory-limit: its own exit status, for a supervisor to count."""

    exit_code = MEMORY_EXIT


class Group(click.Group):
    """Turns a KvlensError or a usage error from any command into one ``Error:`` line and exit 1
    (3 for a command stopped at its memory limit: ``MemoryLimitError``)."""

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as e:
            raise _usage_error(e) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KvlensError as e:
            kind = _StoppedAtLimit if e.exit_code == MEMORY_EXIT else click.ClickException
            raise kind(_one_line(str(e))) from e
        except click.UsageError as e:
            raise _usage_error(e) from None


class LazyChoice(click.Choice):
    """Choices read from ``load`` when click first needs them (the CLI imports packages lazily)."""

    def __init__(self, load: Callable[[], Sequence[str]]) -> None:
        self._load = load
        super().__init__((), case_sensitive=True)

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(self._load())

    @choices.setter
    def choices(self, _value: object) -> None:
        pass


def progress_bar(paths: tuple[str, ...], label: str) -> Any:
    """A progress bar on stderr over the bytes of ``paths``."""
    total = sum(Path(p).stat().st_size for p in paths if Path(p).is_file())
    return click.progressbar(length=total, label=label, file=sys.stderr, show_eta=True,
                             show_percent=True, width=30)


def items_bar(label: str) -> Callable[[list[str]], Any]:
    """A progress bar on stderr over the items it is given, showing the one in progress."""
    def bar(items: list[str]) -> Any:
        return click.progressbar(items, label=label, file=sys.stderr, width=30,
                                 item_show_func=lambda s: s or "")
    return bar


STOP_GRACE_ENV = "KVLENS_STOP_GRACE_S"
# under the README unit's TimeoutStopSec (30 s) and Kubernetes' default termination grace (30 s): a
# stop that hangs says where before the SIGKILL
STOP_GRACE_S = 25.0


def stop_grace_s() -> float:
    """Seconds a stopped command has to exit: ``KVLENS_STOP_GRACE_S``, else 25."""
    raw = os.environ.get(STOP_GRACE_ENV, "")
    try:
        value = float(raw) if raw else STOP_GRACE_S
    except ValueError:
        raise ConfigError(f"{STOP_GRACE_ENV}={raw!r} is not a number of seconds: unset it or give "
                          "e.g. 25") from None
    return value if value > 0 else STOP_GRACE_S


_OWNS_PROCESS = False  # set by the console entry (kvlens.cli.main): this process is the command


def own_the_process() -> None:
    """The command is this process (the console entry, ``python -m kvlens.cli``): a stop that
    hangs may end it (``_arm_stop_watchdog``). Not in a library caller's process (a test runner,
    an embedding program): there a signal scope only calls ``stop``."""
    global _OWNS_PROCESS
    _OWNS_PROCESS = True


def _arm_stop_watchdog(grace_s: float) -> None:
    """After a stop signal, a shutdown that outlives ``grace_s`` prints every thread's stack to
    stderr and exits with status 1 (faulthandler's watchdog thread: it needs neither the GIL nor a
    live main thread). Left armed past the signal scope: a hang can come later, at the
    interpreter's exit. Whatever was committed before stays; the collectors' checkpoints move only
    with a commit, so their next start asks the publishers' replay for the rest."""
    with contextlib.suppress(RuntimeError, ValueError, OSError):  # no usable stderr: no watchdog
        faulthandler.dump_traceback_later(grace_s, exit=True, file=sys.stderr)


@contextlib.contextmanager
def stopped_by_signals(stop: Callable[[], object]) -> Iterator[None]:
    """While inside, SIGTERM and SIGINT call ``stop`` (the loop then ends as after its --duration);
    the previous handlers come back on the way out. Every long-running command runs in one.

    A stop is bounded when the command owns its process (``own_the_process``): past
    ``KVLENS_STOP_GRACE_S`` (25 s) after the first signal, the process prints every thread's stack
    and exits (``_arm_stop_watchdog``)."""
    grace_s = stop_grace_s()
    stopping: list[bool] = []

    def on_signal(*_: object) -> None:
        if not stopping:
            stopping.append(True)
            if _OWNS_PROCESS:
                _arm_stop_watchdog(grace_s)
        stop()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def given_model(model: str | None, model_config: str | None) -> Any:
    """The geometry --model or --model-config names (None when neither); both at once is an error."""
    from kvlens.models import from_hf_config, get_model

    if model and model_config:
        raise ConfigError(f"--model {model} and --model-config {model_config} both name the model: give one")
    if model_config:
        return from_hf_config(model_config)
    return get_model(model) if model else None


def model_name(model: str | None, model_config: str | None) -> str | None:
    """The model name to record on rows: --model as given (any name), or the name in --model-config's file."""
    if model_config:
        return str(given_model(model, model_config).name)
    return model


def parse_now(value: str | None) -> int | None:
    """--now as nanoseconds since the epoch (a time without a zone is UTC); None stays None."""
    from datetime import UTC, datetime

    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"{value!r}: give an ISO time such as 2025-01-02T00:00:00Z",
                                 param_hint="--now") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp()) * 10**9 + moment.microsecond * 1000


def parse_token_ids(text: str) -> list[int]:
    """Token ids separated by spaces, commas or newlines (a JSON array works too): kvlens hash's stdin."""
    try:
        return [int(t) for t in re.split(r"[\s,\[\]]+", text) if t]
    except ValueError as e:
        raise InputError(f"stdin holds something other than token ids: {e}") from None
