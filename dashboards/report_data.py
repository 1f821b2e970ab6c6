"""Dashboards: the numbers behind the report, read from the analysis DB for one time window.

Every query reads analysis tables only (never the lake views the DB also holds) with bound
parameters; a table that is absent or empty yields nothing, and its section is left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb

from kvlens.errors import ConfigError
from kvlens.query import connect
from kvlens.schema import HIT_OUTCOMES_SQL

__all__ = [
    "Headline",
    "LedgerRow",
    "Window",
    "default_now_ns",
    "has_rows",
    "headlines",
    "latest_arrivals",
    "ledger",
    "open_db",
    "rows",
    "scenario_names",
]



@dataclass(frozen=True)
class Window:
    """Requests arriving in [start_ns, end_ns)."""

    start_ns: int
    end_ns: int

    def previous(self) -> Window:
        return Window(2 * self.start_ns - self.end_ns, self.start_ns)

    def label(self) -> str:
        return f"{_utc(self.start_ns)} to {_utc(self.end_ns)}"


def _utc(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


@dataclass(frozen=True)
class Headline:
    """One scenario's totals in a window."""

    scenario: str
    requests: int
    prompt_tokens: int
    hit_tokens: int
    tail_partial_tokens: int
    hit_bytes: int
    prompt_bytes: int | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    unobserved_tokens: int = 0

    @property
    def observed(self) -> bool:
        """Some prompt token ran on a replica that published KV events (else no ratio is known)."""
        return self.prompt_tokens - self.tail_partial_tokens > self.unobserved_tokens

    @property
    def token_hit_ratio(self) -> float | None:
        """Hit tokens over prompt tokens (partial tails count as recomputed); None without events."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens and self.observed else None

    @property
    def byte_hit_ratio(self) -> float | None:
        """Hit KV bytes over the KV bytes of every prompt token (the dashboard's definition)."""
        return self.hit_bytes / self.prompt_bytes if self.prompt_bytes and self.observed else None


@dataclass(frozen=True)
class LedgerRow:
    scenario: str
    outcome: str
    tokens: int
    bytes: int


def open_db(db: str | Path) -> duckdb.DuckDBPyConnection:
    """A read-only connection to the analysis DB (never the lake); a one-line error if it is not one."""
    try:
        con = connect(db=db)
    except duckdb.Error as e:
        raise ConfigError(f"cannot open analysis DB {db}: {str(e).splitlines()[0]}: "
                          "pass a file written by kvlens analyze") from None
    if not _has_table(con, "request_ledger"):
        con.close()
        raise ConfigError(f"{db} is not a kvlens analysis DB (no request_ledger table): "
                          "pass a file written by kvlens analyze")
    return con


def _has_table(con: duckdb.DuckDBPyConnection, table: str) -> bool:
    ((found,),) = con.execute("SELECT count(*) FROM duckdb_tables() WHERE database_name = 'analysis' "
                              "AND table_name = ?", [table]).fetchall()
    return bool(found)


def rows(con: duckdb.DuckDBPyConnection, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Run one bound query; only the parameters the SQL names are passed."""
    used = {k: v for k, v in params.items() if f"${k}" in sql}
    return con.execute(sql, used).fetchall()


def has_rows(con: duckdb.DuckDBPyConnection, table: str) -> bool:
    """Whether the analysis DB holds ``table`` (a schema name, never user input) with any row."""
    if not _has_table(con, table):
        return False
    # fetchall, not fetchone: a result left open would block the next relation on this connection.
    ((found,),) = con.execute(f"SELECT EXISTS (SELECT 1 FROM analysis.main.{table})").fetchall()
    return bool(found)


def scenario_names(con: duckdb.DuckDBPyConnection, chosen: list[str] | None) -> list[str]:
    """The analyzed scenarios (or the chosen ones that were analyzed), sorted."""
    found = con.execute("SELECT DISTINCT scenario FROM request_ledger ORDER BY 1").fetchall()
    present = [r[0] for r in found]
    if not chosen:
        return present
    return sorted(s for s in set(chosen) if s in present)


DEFAULT_NOW_SQL = "SELECT max(arrival_ns) FROM request_ledger WHERE list_contains($names, scenario)"


def default_now_ns(con: duckdb.DuckDBPyConnection, names: list[str]) -> int | None:
    """Just after the latest arrival, so that the window ending now includes it."""
    latest = rows(con, DEFAULT_NOW_SQL, {"names": names})[0][0]
    return None if latest is None else int(latest) + 1


LATEST_SQL = """
SELECT scenario, max(arrival_ns) FROM request_ledger WHERE list_contains($names, scenario)
GROUP BY scenario ORDER BY scenario
"""


def latest_arrivals(con: duckdb.DuckDBPyConnection, names: list[str]) -> dict[str, int]:
    """Per scenario: just after its latest arrival (a replayed trace keeps its own epoch)."""
    return {s: int(t) + 1 for s, t in rows(con, LATEST_SQL, {"names": names}) if t is not None}


_IN_WINDOW = "list_contains($names, scenario) AND arrival_ns >= $start AND arrival_ns < $end"

HEADLINE_SQL = f"""
WITH r AS (
    SELECT scenario, count(*) AS requests, sum(prompt_tokens) AS prompt_tokens,
           sum(hit_tokens) AS hit_tokens, sum(tail_partial_tokens) AS tail_partial_tokens,
           median(ttft_ms) AS ttft_p50_ms, quantile_cont(ttft_ms, 0.99) AS ttft_p99_ms,
           sum(coalesce(unobserved_tokens, 0)) AS unobserved_tokens
    FROM request_ledger WHERE {_IN_WINDOW} GROUP BY scenario
), b AS (
    SELECT scenario, sum(bytes) FILTER (WHERE outcome IN {HIT_OUTCOMES_SQL}) AS hit_bytes
    FROM block_outcomes WHERE {_IN_WINDOW} GROUP BY scenario
)
SELECT r.scenario, r.requests, r.prompt_tokens, r.hit_tokens, r.tail_partial_tokens,
       coalesce(b.hit_bytes, 0), r.prompt_tokens * s.kv_bytes_per_token, r.ttft_p50_ms, r.ttft_p99_ms,
       r.unobserved_tokens
FROM r LEFT JOIN b USING (scenario) LEFT JOIN scenarios s USING (scenario) ORDER BY r.scenario
"""


def _params(names: list[str], window: Window) -> dict[str, Any]:
    return {"names": names, "start": window.start_ns, "end": window.end_ns}


def headlines(con: duckdb.DuckDBPyConnection, names: list[str], window: Window) -> dict[str, Headline]:
    """Per scenario with requests in the window: its totals."""
    out = {}
    for r in rows(con, HEADLINE_SQL, _params(names, window)):
        out[r[0]] = Headline(r[0], int(r[1]), int(r[2] or 0), int(r[3] or 0), int(r[4] or 0), int(r[5]),
                             None if r[6] is None else int(r[6]), r[7], r[8], int(r[9] or 0))
    return out


LEDGER_SQL = f"""
SELECT scenario, CAST(outcome AS VARCHAR), sum(tokens), sum(bytes)
FROM block_outcomes WHERE {_IN_WINDOW} GROUP BY ALL ORDER BY 1, 2
"""


def ledger(con: duckdb.DuckDBPyConnection, names: list[str], window: Window) -> list[LedgerRow]:
    """Tokens and bytes per scenario and outcome for the window's requests."""
    return [LedgerRow(s, o, int(t), int(b)) for s, o, t, b in rows(con, LEDGER_SQL, _params(names, window))]
