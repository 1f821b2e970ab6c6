"""The spine's read-only guard: which statements only read, and a DuckDB connection locked to the lake.

Two layers, each enough on its own for what the other misses:

- ``refusal`` decides by DuckDB's own parse (``extract_statements`` and its statement type), never
  by the first word: only ``SELECT`` (which DuckDB also reports for DESCRIBE, SHOW, SUMMARIZE,
  FROM-first queries and VALUES) reads. ``EXPLAIN`` reads only when the statement it explains
  does, because ``EXPLAIN ANALYZE`` (or ``ANALYSE``, or ``EXPLAIN (ANALYZE)``) runs it; the
  explained statement is found with DuckDB's tokenizer, so comments and spellings do not matter.
- ``lock_down`` turns off what a read still could reach: external access (``read_text``,
  ``read_csv``, ``read_blob``, ``glob``, ``COPY``, ``ATTACH``, ``INSTALL``/``LOAD`` of files
  outside), extension autoload and autoinstall, Python replacement scans, and then locks the
  configuration so no ``SET`` undoes it. DuckDB's ``allowed_directories`` keeps exactly the
  lake's table directories readable (the views' Parquet globs); the analysis DB is attached
  before the lock. ``allowed_directories`` lets writes through as well as reads, so the
  statement check is what keeps ``COPY ... TO`` out of the lake itself.

DuckDB's settings: https://duckdb.org/docs/stable/configuration/overview (enable_external_access,
allowed_directories, lock_configuration, autoload_known_extensions, autoinstall_known_extensions).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import duckdb

from kvlens.errors import ConfigError, KvlensError
from kvlens.schema import LAKE_TABLES

__all__ = ["lake_view_dirs", "lock_down", "refusal", "sandbox_config"]

_READ_KINDS = frozenset({"SELECT"})
_EXPLAIN_FLAGS = frozenset({"analyze", "analyse"})
_DB_VIEWS_SQL = ("SELECT sql FROM duckdb_views() WHERE database_name = ? AND NOT internal "
                 "AND sql IS NOT NULL")
# The glob open_lake writes into a view: read_parquet('<lake>/<table>/scenario=*/date=*/*.parquet', ...
_VIEW_GLOB = re.compile(r"read_parquet\('((?:[^']|'')+)/scenario=\*/date=\*/\*\.parquet'")


def sandbox_config() -> dict[str, str | bool | int | float | list[str]]:
    """Settings a sandboxed connection is opened with (the rest is set by ``lock_down``)."""
    return {"autoload_known_extensions": False, "autoinstall_known_extensions": False,
            "allow_community_extensions": False, "python_enable_replacements": False}


def _statements(con: duckdb.DuckDBPyConnection, text: str) -> list[duckdb.Statement]:
    try:
        return con.extract_statements(text)
    except duckdb.Error as e:
        raise KvlensError(f"query does not parse: {str(e).splitlines()[0]}") from None


def _kind(statement: duckdb.Statement) -> str:
    try:
        return statement.type.name
    except ValueError:  # a statement type the Python binding has no name for
        return "UNKNOWN"


def _explained(text: str) -> list[str]:
    """What an EXPLAIN statement may be explaining: the text after EXPLAIN [ANALYZE] and, when an
    option list ``( ... )`` follows, also the text after it (``EXPLAIN (SELECT 1)`` is a query)."""
    tokens = duckdb.tokenize(text)
    starts = [pos for pos, _ in tokens]
    words = [text[a:b].strip() for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]
    code = [i for i, (_, kind) in enumerate(tokens) if kind != duckdb.token_type.comment]
    if not code or words[code[0]].lower() != "explain":
        return []
    at = 1
    while at < len(code) and words[code[at]].lower() in _EXPLAIN_FLAGS:
        at += 1
    if at >= len(code):
        return []
    candidates = [starts[code[at]]]
    if words[code[at]] == "(":
        depth = 0
        for j in code[at:]:
            depth += (words[j] == "(") - (words[j] == ")")
            if depth == 0:
                candidates += [starts[j + 1]] if j + 1 < len(starts) else []
                break
    return [text[c:] for c in candidates]


def refusal(con: duckdb.DuckDBPyConnection, text: str) -> str | None:
    """None when ``text`` is one statement that only reads; else what it is, for the message."""
    statements = _statements(con, text)
    if len(statements) != 1:
        raise ConfigError(f"expected exactly one statement, got {len(statements)}: "
                          "send one query per kvlens sql call")
    kind = _kind(statements[0])
    if kind in _READ_KINDS:
        return None
    if kind == "MULTI":  # DuckDB runs a PIVOT without IN (...) as CREATE TYPE, then SELECT
        return "MULTI (a PIVOT without ON ... IN (...): name the values to pivot on)"
    if kind != "EXPLAIN":
        return kind
    verdicts = []
    for inner in _explained(statements[0].query):
        try:
            parsed = con.extract_statements(inner)
        except duckdb.Error:
            continue
        if len(parsed) == 1:
            verdicts.append(refusal(con, inner))
    if not verdicts:
        return "EXPLAIN of a statement kvlens cannot identify"
    refused = [v for v in verdicts if v is not None]
    return f"EXPLAIN {refused[0]}" if refused else None


def lake_view_dirs(con: duckdb.DuckDBPyConnection, database: str) -> list[Path]:
    """The lake table directories the views of ``database`` read: only globs of the exact shape
    ``open_lake`` writes, ending in a lake table's name, are taken (a lake that has moved since
    then still fails with DuckDB's "no files found" naming the old path)."""
    tables = {t.name for t in LAKE_TABLES}
    dirs = set()
    for (sql,) in con.execute(_DB_VIEWS_SQL, [database]).fetchall():
        for m in _VIEW_GLOB.finditer(sql):
            path = Path(m.group(1).replace("''", "'"))
            if path.name in tables and path.is_absolute():
                dirs.add(path)
    return sorted(dirs)


def lock_down(con: duckdb.DuckDBPyConnection, readable_dirs: Iterable[Path]) -> None:
    """Leave ``con`` able to read only ``readable_dirs`` (and what it attached), for good."""
    allowed = sorted({str(Path(d).resolve()).rstrip("/") + "/" for d in readable_dirs})
    con.execute("SET allowed_directories = ?", [allowed])
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
