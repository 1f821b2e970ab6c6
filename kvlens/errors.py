"""The spine's error tree: every failure an operator can act on is one of these.

    KvlensError                 base; the CLI prints ``Error: <message>`` and exits 1
    ├── InputError              bad bytes or lines from outside (file, line, field named)
    ├── ConfigError             a setting, flag or model name that cannot be used
    ├── SchemaVersionError      a lake or database written by another schema version
    ├── NoDataError             a query or analysis found nothing to work on
    │   └── EmptyReplaceError   a replace (an import) read no rows; the scenario was kept
    ├── ReadOnlyError           a write was attempted through a read-only interface
    └── MemoryLimitError        a command's resident memory passed its --memory-limit; exit
                                status MEMORY_EXIT (3), so a supervisor tells it from a failure

A message says what is wrong, where, and what to do. Bugs are not KvlensErrors and keep
their tracebacks.
"""

from __future__ import annotations

__all__ = [
    "MEMORY_EXIT",
    "ConfigError",
    "EmptyReplaceError",
    "InputError",
    "KvlensError",
    "MemoryLimitError",
    "NoDataError",
    "ReadOnlyError",
    "SchemaVersionError",
]


# The exit status of a command stopped at its memory limit (kvlens/memory.py): ``kvlens serve``
# counts its analyses that end so apart from the ones that fail.
MEMORY_EXIT = 3


class KvlensError(Exception):
    """An error the operator can fix; its message is one line. The CLI exits with ``exit_code``."""

    exit_code = 1


class InputError(KvlensError):
    """Input that cannot be parsed; the message names the file, line and field."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None,
                 field: str | None = None) -> None:
        where = ", ".join(
            part for part in (
                path,
                f"line {line}" if line is not None else None,
                f"field {field!r}" if field is not None else None,
            ) if part
        )
        super().__init__(f"{where}: {message}" if where else message)
        self.path, self.line, self.field = path, line, field


class ConfigError(KvlensError):
    """A setting, flag or name that cannot be used as given."""


class SchemaVersionError(KvlensError):
    """Data written under a schema version this kvlens does not read."""


class NoDataError(KvlensError):
    """Nothing to work on: an empty lake, scenario or table."""


class EmptyReplaceError(NoDataError):
    """A replace that read no rows: refused, so the scenario keeps its previous rows."""


class ReadOnlyError(KvlensError):
    """A statement that would write, sent through a read-only interface."""


class MemoryLimitError(KvlensError):
    """The command's resident memory passed the limit it was given (kvlens/memory.py)."""

    exit_code = MEMORY_EXIT
