"""Analyzers' mergeable aggregates of lake relations, continued across ``kvlens analyze`` runs.

Some analyses reduce a whole lake table to a small aggregate: counts and sums per key, a first
time per key, a set of distinct keys. Such an aggregate of the whole table is the merge of the
aggregate of its rows stamped before a time ``T`` and that of the rows from ``T`` on (and the
unstamped ones). ``kvlens analyze`` guarantees that no row stamped before its horizon arrives in a
later run (it rebuilds on a late segment), so ``Scans`` keeps, per aggregate, the merged
aggregate of the rows before the horizon (``ScanState``), and the next run scans only the rows
from that checkpoint on: parquet statistics let DuckDB skip the older segments, so the scan costs
what the new data costs, not what the lake holds.

What it buys grows with the lake: on the 392k kv_events rows of tests/bench/bench_incremental.py's
lake (6 segments) a scan costs about 5 ms whatever it reads (opening the files), so the state
saves little; on ten times that (3.9M rows, 60 segments) one of these aggregates took 57.7 ms over
the whole table and 10.9 ms over its last 17% (measured, DuckDB on 2 cores).

Before continuing, ``Scans`` checks that each lake relation holds as many rows before the
checkpoint as when the state was saved; otherwise it computes every aggregate over the whole
relation (and says why). When the run knows that a relation gained no row stamped before the
checkpoint (``unchanged_before``: an appended run's new segments all start at or after it), the
check holds without a scan, and the count for the next state reads only the rows from the
checkpoint on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import duckdb
import polars as pl

from kvlens.analyzers.state_blob import pack, still_counted, unpack

__all__ = ["SCANS_TABLE", "ScanState", "Scans", "grouped"]

log = logging.getLogger(__name__)


def grouped(rel: duckdb.DuckDBPyRelation, sql: str, name: str = "outcomes") -> pl.DataFrame:
    """``sql``'s rows over ``rel`` (named ``name`` in it), as a frame: an aggregate DuckDB computes,
    spilling past its memory limit, where the analysis' frame would not fit (out of core)."""
    result = rel.query(name, sql)
    if result is None:
        raise ValueError(f"no rows from a statement that returns none: {sql[:60]}")
    return result.pl()

SCANS_TABLE = "kvlens_scans"  # a scenario's ScanState, in the analysis DB beside its rows
Merge = Literal["sum", "min", "max"]
_SETTLED = "_kvlens_settled"


@dataclass(frozen=True)
class ScanState:
    """Each aggregate of the rows stamped before ``checkpoint_ns``, and how many rows each lake
    relation had before it."""

    checkpoint_ns: int
    rows: dict[str, int]
    frames: dict[str, pl.DataFrame]

    def to_bytes(self) -> bytes:
        return pack({"checkpoint_ns": self.checkpoint_ns, "rows": self.rows}, self.frames)

    @classmethod
    def from_bytes(cls, data: bytes) -> ScanState:
        head, frames = unpack(data)
        return cls(int(head["checkpoint_ns"]), {k: int(v) for k, v in head["rows"].items()}, frames)


@dataclass
class Scans:
    """Mergeable aggregates of a scenario's lake relations (``relations``: name -> (relation, its
    time column)), continued from ``resume`` where its row counts hold, and saved at
    ``checkpoint_ns`` when given. One object serves one scenario's run."""

    relations: Mapping[str, tuple[duckdb.DuckDBPyRelation, str]]
    resume: ScanState | None = None
    checkpoint_ns: int | None = None
    refused: str | None = None
    # Per relation: a time before which it holds the rows it held when ``resume`` was saved
    # (analyzers/incremental.py, ``new_rows_from``): its count before the state's checkpoint is then
    # the state's, and only the rows from that checkpoint on are counted for the new one.
    unchanged_before: Mapping[str, int] = field(default_factory=dict)
    _frames: dict[str, pl.DataFrame] = field(default_factory=dict)
    _rows: dict[str, int] = field(default_factory=dict)  # per relation: rows before checkpoint_ns

    def __post_init__(self) -> None:
        """One count per relation: its rows before the state's checkpoint (to check it) and before
        the new one (for the next state)."""
        st = self.resume
        if st is not None and self.checkpoint_ns is not None and self.checkpoint_ns < st.checkpoint_ns:
            self._refuse("the new checkpoint is before the state's")
        marks = [t for t in (self.resume.checkpoint_ns if self.resume else None, self.checkpoint_ns)
                 if t is not None]
        if not marks:
            return
        for name, (rel, time_col) in self.relations.items():
            st = self.resume
            if st is not None and name in st.rows and still_counted(self.unchanged_before.get(name),
                                                                    st.checkpoint_ns):
                if self.checkpoint_ns is not None:
                    ((more,),) = rel.filter(f"{time_col} >= {int(st.checkpoint_ns)}").aggregate(
                        f"count(*) FILTER (WHERE {time_col} < {int(self.checkpoint_ns)})").fetchall()
                    self._rows[name] = st.rows[name] + int(more)
                continue
            (counts,) = rel.aggregate(", ".join(f"count(*) FILTER (WHERE {time_col} < {int(t)})"
                                                for t in marks)).fetchall()
            if self.checkpoint_ns is not None:
                self._rows[name] = int(counts[-1])
            if self.resume is not None and counts[0] != self.resume.rows.get(name):
                self._refuse(f"{counts[0]:,} {name} rows before the checkpoint, the state counted "
                             f"{self.resume.rows.get(name)}")

    def _refuse(self, why: str) -> None:
        self.refused, self.resume = why, None
        log.info("lake aggregates computed in full: %s", why)

    def aggregate(self, name: str, source: str, rel: duckdb.DuckDBPyRelation, keys: list[str],
                  values: Mapping[str, tuple[str, Merge]] | None = None) -> pl.DataFrame:
        """``rel`` (rows of lake relation ``source``) grouped by ``keys`` (each a column, or
        ``expression AS name``) with ``values`` (alias -> (SQL aggregate, how two partial
        aggregates merge: give sums a BIGINT cast, DuckDB sums integers as HUGEINT)); no values:
        the distinct keys. Columns: the keys' names, then the values'. Row order is not defined."""
        values = dict(values or {})
        time_col = self.relations[source][1]
        groups, names = _split(keys)
        prior = self.resume.frames.get(name) if self.resume is not None else None
        if self.resume is not None and prior is not None:  # (an aggregate the state lacks: in full)
            since = int(self.resume.checkpoint_ns)
            rel = rel.filter(f"{time_col} >= {since} OR {time_col} IS NULL")
        settled = ("false" if self.checkpoint_ns is None
                   else f"coalesce({time_col} < {int(self.checkpoint_ns)}, false)")
        exprs = [*keys, *(f"{sql} AS {alias}" for alias, (sql, _) in values.items()),
                 f"{settled} AS {_SETTLED}"]
        part = rel.aggregate(", ".join(exprs), ", ".join([*groups, settled])).pl()
        whole = _merged([prior, part.drop(_SETTLED)], names, values)
        if self.checkpoint_ns is not None:
            self._frames[name] = _merged([prior, part.filter(pl.col(_SETTLED)).drop(_SETTLED)], names, values)
        return whole

    def state(self) -> ScanState | None:
        """The state at ``checkpoint_ns`` (None without one)."""
        if self.checkpoint_ns is None:
            return None
        return ScanState(self.checkpoint_ns, dict(self._rows), dict(self._frames))


def _split(keys: list[str]) -> tuple[list[str], list[str]]:
    """(grouping expressions, column names) of ``keys``: a column, or ``expression AS name``."""
    parts = [[p.strip() for p in k.rsplit(" AS ", 1)] for k in keys]
    return [p[0] for p in parts], [p[-1] for p in parts]


def _merged(parts: list[pl.DataFrame | None], names: list[str], values: Mapping[str, tuple[str, Merge]]
            ) -> pl.DataFrame:
    # In no particular order (``aggregate`` promises none): a group-by that keeps the order took
    # twice as long on the content hashes of the isolation audit, an aggregate as large as the
    # blocks ever stored, merged twice a run.
    frames = [p for p in parts if p is not None]
    if len(frames) == 2 and len(names) == 1 and frames[0].height > frames[1].height \
            and not frames[0][names[0]].null_count() and not frames[1][names[0]].null_count():
        # A continued aggregate (the prior) grows with the lake's age, its new part with the rows
        # since the checkpoint: only the prior's groups the part names are merged, the rest kept
        # as they are (the content hashes of the isolation audit: a third of the time of a merge
        # of every group on the steady lake's 5th state, 54k groups).
        prior, part = frames
        named = prior[names[0]].is_in(part[names[0]].implode())
        return pl.concat([prior.filter(~named), _merged([prior.filter(named), part], names, values)],
                         how="vertical_relaxed")
    frame = pl.concat(frames, how="vertical_relaxed") if len(frames) > 1 else frames[0]
    if not values:
        return frame.select(names).unique()
    merged = [getattr(pl.col(alias), how)() for alias, (_, how) in values.items()]  # sum, min or max
    return frame.group_by(names).agg(merged)
