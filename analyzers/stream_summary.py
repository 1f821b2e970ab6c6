"""Analyzers: the `requests` stream's curves and TTL table from its LRU stack and a summary of the
accesses before a checkpoint, not from every access the scenario ever had (issue 16).

mrc's curves and ttl_coverage read the whole `requests` stream (analyzers/reuse.py
``request_stream``): a continued analysis that read its history again and computed its distances
again would cost what the lake's age costs. When every access has one size (every full block has
the scenario's block size: the usual case), what they need of the accesses before a checkpoint is
small, and exact:

- **the stream's LRU stack** there (each key once, at its last access), replayed before the
  accesses after it: each of those gets the distance, interval and previous access a replay of
  the whole stream gives (``reuse._resumed`` says why). The reuse state keeps it beside every
  replica's stack.
- **the exact histogram** of the re-accesses before it: a count per distance in blocks. A curve
  sums counts (``mrc.curve``), and the sum of the counts is the sum of the re-accesses.
- **the same of the SHARDS sample**: the sample's keys are the stack's sampled keys, in order, so
  their stack is the stack's sampled rows.
- **per TTL** (``Summary.ttls_ns``): the re-accesses it covers; of the bytes a TTL cache holds
  (each access keeps its block until the first of its time + TTL, its key's next access, the
  end), the byte-nanoseconds of the residencies settled before the checkpoint (their key's next
  access came before it), summed exactly as integers; the latest of their ends; and the peak held
  just after each access before it. The residencies the stack's accesses opened are still open:
  they are computed again, with the new accesses, from the stack (their key's next access, their
  expiry or the end decide them).

A full computation is a continuation from no summary: one code takes both (``requests_curves``),
so a continued table equals a full one exactly, integer sums and the same float divisions. A
stream with more than one size is computed whole, by mrc.py's and capacity.py's per-record code,
and keeps no summary (its next analysis reads it whole again).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import duckdb
import numba
import numpy as np
import polars as pl

from kvlens.analyzers.reuse import (
    _FULL_BLOCK,
    CHUNK_ROWS,
    AccessStream,
    StreamChunk,
    Summary,
    _last_accesses,
    key_hashes,
    requests_read,
    reuse_distances,
)

__all__ = ["Curves", "CurvesChain", "TtlRow", "curves_out_of_core", "exact_sum", "requests_curves",
           "sample_threshold"]

_TWO64 = 2.0**64
_NONE = -(2**62)  # no residency end or peak yet (as capacity.py's per-record code starts them)


def sample_threshold(rate: float) -> np.uint64 | None:
    """The SHARDS fixed-rate threshold on ``key_hashes`` (a key is sampled below it); None: every key."""
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"rate must be in (0, 1], got {rate}")
    return np.uint64(min(int(rate * _TWO64), 2**64 - 1)) if rate < 1.0 else None


@dataclass(frozen=True)
class TtlRow:
    """One TTL's figures over the whole stream (capacity.py's ``ttl_coverage`` makes its row)."""

    ttl_ns: int
    covered: int  # re-accesses whose interval is at most the TTL
    held: int  # byte-nanoseconds held, exact
    span_ns: int  # from the first access to the last residency's end (at least 1)
    peak: int  # bytes held just after an access, at most


@dataclass(frozen=True)
class Curves:
    """The `requests` stream's figures for mrc and ttl_coverage, and its summary at a checkpoint.

    ``exact`` and ``sampled``: re-accesses per distance in blocks (the index), over the whole
    stream, in it and in its SHARDS sample; ``accesses`` and ``sampled_accesses``: all accesses.
    Every access is ``tokens`` tokens of ``size`` bytes."""

    tokens: int
    size: int
    accesses: int
    exact: np.ndarray
    sampled: np.ndarray | None  # None: no sample rate asked
    sampled_accesses: int
    rate: float | None
    ttl: tuple[TtlRow, ...]
    summary: Summary | None = None  # at the checkpoint asked (None: none asked, or unstamped accesses)
    stack: pl.DataFrame | None = None  # the stream's LRU stack there (block_hash, size, ts_ns)


def exact_sum(hi: int, lo: int) -> int:
    """The integer a (hi, lo) pair of unsigned 64-bit words holds."""
    return (int(hi) << 64) + int(lo)


@numba.njit(cache=True, inline="always")
def _add(hi: np.uint64, lo: np.uint64, a: np.uint64) -> tuple[np.uint64, np.uint64]:
    """(hi, lo) + a, exact: a 128-bit sum of unsigned 64-bit words (nanoseconds held sum past 64
    bits on a long stream; times a block's bytes they pass int64 sooner: a 512-token block of a 70B
    model held 60 s is 1.0e19 byte-ns)."""
    out = lo + a
    if out < lo:
        hi += np.uint64(1)
    return hi, out


@numba.njit(cache=True)
def _ttl_kernel(ts: np.ndarray, nxt: np.ndarray, ttls_ns: np.ndarray, cap: int, start: int,
                settled: int) -> tuple[np.ndarray, ...]:
    """Per TTL, over a stream of blocks of one size in time order whose first ``start`` accesses
    are a stack replayed (each key's last access before a checkpoint) and whose first ``settled``
    accesses come before the next one: the nanoseconds every residency held its block (a (hi, lo)
    pair of words: times the block's bytes, the byte-nanoseconds) and their latest end, the same
    of those whose key's next access comes before ``settled``; and the most blocks held just after
    an access from ``start`` on, and just after one before ``settled``.

    A residency stops at its expiry (``ts + TTL``, capped at ``cap``) unless the key's next access
    renews it first; then at that access's time. Held after access a: the blocks accessed up to it
    less those stopped at or before its time (stops first at a tie). Both kinds of stop come in
    time order (expiries in their accesses' order, renewals in the renewing accesses'), so two
    cursors walk them beside the accesses. The stack's residencies are the only ones of the
    history still open at the checkpoint, so from ``start`` on the held blocks are the whole
    stream's."""
    n, k = ts.shape[0], ttls_ns.shape[0]
    hi, lo = np.zeros(k, np.uint64), np.zeros(k, np.uint64)
    set_hi, set_lo = np.zeros(k, np.uint64), np.zeros(k, np.uint64)
    last, set_last = np.full(k, _NONE, np.int64), np.full(k, _NONE, np.int64)
    peak, set_peak = np.full(k, _NONE, np.int64), np.full(k, _NONE, np.int64)
    renewed = np.zeros(n, np.bool_)  # residency i ends at its renewal
    renews = np.zeros(n, np.bool_)  # access j renews a residency
    gap = np.empty(n, np.int64)  # to the key's next access (read once, in order)
    for i in range(n):
        gap[i] = ts[nxt[i]] - ts[i] if nxt[i] >= 0 else -1
    for q in range(k):
        ttl_ns = ttls_ns[q]
        renews[:] = False
        h, w, sh, sw = np.uint64(0), np.uint64(0), np.uint64(0), np.uint64(0)
        end, set_end = _NONE, _NONE
        for i in range(n):
            g = gap[i]
            renewed[i] = 0 <= g <= ttl_ns
            if renewed[i]:
                stop = ts[i] + g
                renews[nxt[i]] = True
            else:
                stop = ts[i] + ttl_ns
            stop = min(stop, cap)
            h, w = _add(h, w, np.uint64(stop - ts[i]))
            end = max(end, stop)
            if 0 <= nxt[i] < settled:  # the key came back before the checkpoint: this residency is settled
                sh, sw = _add(sh, sw, np.uint64(stop - ts[i]))
                set_end = max(set_end, stop)
        hi[q], lo[q], set_hi[q], set_lo[q], last[q], set_last[q] = h, w, sh, sw, end, set_end
        held, top, set_top = 0, _NONE, _NONE
        e, r = 0, 0
        for a in range(n):
            t = ts[a]
            held += 1
            while e < n and (renewed[e] or min(ts[e] + ttl_ns, cap) <= t):
                if not renewed[e]:
                    held -= 1
                e += 1
            while r < n and (not renews[r] or min(ts[r], cap) <= t):
                if renews[r]:
                    held -= 1
                r += 1
            if a >= start:
                top = max(top, held)
                if a < settled:
                    set_top = max(set_top, held)
        peak[q], set_peak[q] = top, set_top
    return hi, lo, last, peak, set_hi, set_lo, set_last, set_peak


def _added(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Two count-per-distance arrays summed (the longer's length)."""
    out = np.zeros(max(a.shape[0], b.shape[0]), np.int64)
    out[:a.shape[0]] += a
    out[:b.shape[0]] += b
    return out


def _counts(distances: np.ndarray) -> np.ndarray:
    return np.bincount(distances, minlength=0).astype(np.int64) if distances.size else np.zeros(0, np.int64)


def requests_curves(acc: AccessStream, *, rate: float | None, ttls_s: tuple[float, ...],
                    cut_ns: int | None = None) -> Curves | None:
    """The `requests` stream's curves and TTL figures (``Curves``), continued from ``acc``'s
    summary when it was read from one; with ``cut_ns``, the summary and stack there. None when its
    accesses have more than one size (the per-record code computes them, from the whole stream)."""
    prior = acc.summary
    sizes = acc.sizes
    if prior is None:
        if sizes.shape[0] == 0 or sizes.min() != sizes.max():
            return None
        tokens = int(acc.frame["block_tokens"][0])
        size = int(sizes[0])
    else:
        tokens, size = prior.tokens, prior.size
        if sizes.shape[0] and (sizes.min() != size or sizes.max() != size):
            raise ValueError(f"the stream's accesses are not all {size} bytes: it is read whole")
        if (rate is not None and prior.rate != rate) or (ttls_s and prior.ttls_ns != _ttls_ns(ttls_s)):
            raise ValueError("the summary was kept for another sample rate or other TTLs")
    if acc.frame["ts_ns"].null_count():
        return None  # (an access without a time: capacity.py's per-record code)
    m = acc.head
    keys, ts = acc.keys(), acc.times()
    if ts.shape[0] > 1 and not bool(np.all(ts[1:] >= ts[:-1])):
        return None
    n = ts.shape[0]
    d = acc.distances
    # a full computation is a continuation from an empty summary
    base = prior if prior is not None else _empty(tokens, size, rate, _ttls_ns(ttls_s))
    known = base.first_ns
    first = known if known is not None else (int(ts[m]) if n > m else None)
    # the accesses before the cut: the stack, then the new ones stamped before it (in time order)
    settled = n if cut_ns is None else m + int(np.searchsorted(ts[m:], cut_ns, side="left"))
    re = np.flatnonzero(d.prev[m:] >= 0) + m
    exact_new, exact_settled = _counts(d.blocks[re]), _counts(d.blocks[re[re < settled]])
    exact = _added(base.exact, exact_new)
    sampled = sampled_settled = None
    sampled_accesses = sampled_upto = 0
    if rate is not None:
        below = sample_threshold(rate)
        pick = np.ones(n, np.bool_) if below is None else key_hashes(keys, np.uint64(0)) < below
        ms = int(pick[:m].sum())
        ds = reuse_distances(keys[pick], size, distinct_head=ms)
        rs = np.flatnonzero(ds.prev[ms:] >= 0) + ms
        upto = int(pick[:settled].sum())
        sampled_new, sampled_new_settled = _counts(ds.blocks[rs]), _counts(ds.blocks[rs[rs < upto]])
        sampled = _added(base.sampled, sampled_new)
        sampled_settled = _added(base.sampled, sampled_new_settled)
        sampled_accesses = base.sampled_accesses + int(pick[m:].sum())
        sampled_upto = base.sampled_accesses + upto - ms
    # the TTL cache, over the stack and the new accesses
    ttls_ns = np.asarray(_ttls_ns(ttls_s), np.int64)
    nxt = np.full(n, -1, np.int64)
    nxt[d.prev[re]] = re
    cap = int(ts.max()) + 1 if n else 0
    hi, lo, last, peak, s_hi, s_lo, s_last, s_peak = _ttl_kernel(ts, nxt, ttls_ns, cap, m, settled)
    interval = ts[re] - ts[d.prev[re]]
    rows, kept = [], []
    for q, ttl_ns in enumerate(ttls_ns.tolist()):
        covers = interval <= ttl_ns
        covered_new, covered_settled = int(covers.sum()), int(covers[re < settled].sum())
        held = size * exact_sum(hi[q], lo[q]) + base.held[q]
        end = max(int(last[q]), base.last_stop[q])
        rows.append(TtlRow(ttl_ns, covered_new + base.covered[q], held,
                           max(1, end - first) if first is not None else 1,
                           max(_bytes(int(peak[q]), size), base.peak[q])))
        kept.append((covered_settled + base.covered[q], size * exact_sum(s_hi[q], s_lo[q]) + base.held[q],
                     max(int(s_last[q]), base.last_stop[q]), max(_bytes(int(s_peak[q]), size), base.peak[q])))
    summary = stack = None
    if cut_ns is not None:
        stack = _last_accesses(keys, np.full(n, size, np.int64), pl.Series(ts), d.prev, settled)
        summary = Summary(
            tokens=tokens, size=size, accesses=base.accesses + settled - m,
            first_ns=first if known is not None or settled > m else None,
            exact=_added(base.exact, exact_settled),
            sampled=sampled_settled if sampled_settled is not None else np.zeros(0, np.int64),
            sampled_accesses=sampled_upto, rate=rate,
            ttls_ns=tuple(int(t) for t in ttls_ns.tolist()),
            covered=tuple(c for c, _, _, _ in kept), held=tuple(h for _, h, _, _ in kept),
            last_stop=tuple(e for _, _, e, _ in kept), peak=tuple(p for _, _, _, p in kept))
    return Curves(tokens, size, base.accesses + n - m, exact, sampled, sampled_accesses, rate, tuple(rows),
                  summary, stack)


def _empty(tokens: int, size: int, rate: float | None, ttls_ns: tuple[int, ...]) -> Summary:
    """The summary of no access."""
    none = np.zeros(0, np.int64)
    k = len(ttls_ns)
    return Summary(tokens, size, 0, None, none, none, 0, rate, ttls_ns, (0,) * k, (0,) * k, (_NONE,) * k,
                   (_NONE,) * k)


def _bytes(blocks: int, size: int) -> int:
    """A peak in blocks, in bytes (none stays none)."""
    return blocks * size if blocks != _NONE else _NONE


def _ttls_ns(ttls_s: Any) -> tuple[int, ...]:
    return tuple(int(ttl * 1_000_000_000) for ttl in sorted(ttls_s))


class CurvesChain:
    """mrc's and ttl_coverage's figures of the `requests` stream (``Curves``) out of core, from its
    chunks read in order (``reuse.requests_read``; ``add`` is ``reuse_out_of_core``'s
    ``on_chunk``) and, for the TTLs, from DuckDB. Exact: the same integer counts and sums as
    ``requests_curves`` (so ``mrc`` and ``ttl_coverage`` make the same rows from them):

    - the exact re-accesses per distance, summed over the chunks (the distances are a replay of
      the whole stream's: ``reuse.StreamStack``);
    - the SHARDS sample: its accesses' keys are kept (a key is in it by its hash alone, so they are
      the sample's stream, about ``rate`` of the accesses), and its distances computed at the end;
    - per TTL (``_ttl_rows``): each access's gap to its key's next one, from a window in DuckDB.

    In memory: the counts per distance (O(the largest distance)) and the sample's keys."""

    def __init__(self, *, rate: float | None, ttls_s: tuple[float, ...]) -> None:
        self.rate, self.ttls_s = rate, ttls_s
        self._below = sample_threshold(rate) if rate is not None else None
        self._exact = np.zeros(0, np.int64)
        self._sample: list[np.ndarray] = []
        self._accesses, self._tokens, self._size = 0, 0, 0
        self._curves: Curves | None = None

    def add(self, chunk: StreamChunk) -> None:
        """The next chunk of the stream."""
        if not self._accesses:
            self._tokens, self._size = int(chunk.frame["block_tokens"][0]), chunk.size
        self._accesses += chunk.frame.height
        self._exact = _added(self._exact, _counts(chunk.blocks[chunk.blocks >= 0]))
        if self.rate is not None:
            keys = chunk.frame["block_hash"].to_numpy()
            picked = keys if self._below is None else keys[key_hashes(keys, np.uint64(0)) < self._below]
            self._sample.append(picked)

    def done(self, con: duckdb.DuckDBPyConnection, scenario: str) -> Curves:
        """The whole stream's figures, once every chunk is added (the TTLs' read from ``con``'s lake
        views)."""
        if self._curves is None:
            if not self._accesses:
                raise ValueError("no chunk of the stream was added")
            sampled, sampled_accesses = None, 0
            if self.rate is not None:
                keys = np.concatenate(self._sample)
                ds = reuse_distances(keys, self._size)
                sampled, sampled_accesses = _counts(ds.blocks[ds.prev >= 0]), int(keys.shape[0])
            ttl = _ttl_rows(con, scenario, _ttls_ns(self.ttls_s), self._size) if self.ttls_s else ()
            self._curves = Curves(self._tokens, self._size, self._accesses, self._exact, sampled,
                                  sampled_accesses, self.rate, ttl)
        return self._curves


def _ttl_rows(con: duckdb.DuckDBPyConnection, scenario: str, ttls_ns: tuple[int, ...],
              size: int) -> tuple[TtlRow, ...]:
    """``_ttl_kernel``'s figures of the whole `requests` stream (accesses of ``size`` bytes), per
    TTL, computed in DuckDB (which spills), exact integers. Each access's gap ``g`` to its key's
    next access (window by key, in time order: accesses of one time are interchangeable here)
    decides its residency: renewed when ``g <= TTL`` (it holds ``g``), else it stops at
    ``min(ts + TTL, cap)``, ``cap`` the last time + 1. The peak: blocks held just after an access
    are the runs of renewed residencies begun by then (an access not renewing one: ``p``, the gap
    from its key's previous access, NULL or over the TTL) less those ended by then (stops first at
    a tie), at the accesses' times: one row per time, so O(requests) rows in DuckDB."""
    full = f"scenario = ? AND ({_FULL_BLOCK})"
    ((first, last),) = con.execute(
        f"SELECT min(arrival_ns), max(arrival_ns) FROM request_blocks WHERE {full}", [scenario]).fetchall()
    cap = int(last) + 1
    per = []
    for q, ttl in enumerate(ttls_ns):
        per.append(f"count(*) FILTER (WHERE p IS NULL OR p > {ttl}) AS f{q}, "
                   f"count(*) FILTER (WHERE g IS NULL OR g > {ttl}) AS e{q}, "
                   f"count(*) FILTER (WHERE g <= {ttl}) AS c{q}, "
                   f"sum(CASE WHEN g <= {ttl} THEN g ELSE least({ttl}, {cap} - ts) END) AS h{q}, "
                   f"max(CASE WHEN g <= {ttl} THEN ts + g ELSE least(ts + {ttl}, {cap}) END) AS s{q}")
    table = f"kvlens_ttl_{uuid.uuid4().hex}"
    con.execute(
        f"CREATE OR REPLACE TEMP TABLE {table} AS SELECT ts, {', '.join(per)} FROM ("
        "SELECT arrival_ns AS ts, lead(arrival_ns) OVER w - arrival_ns AS g, "
        f"arrival_ns - lag(arrival_ns) OVER w AS p FROM request_blocks WHERE {full} "
        "WINDOW w AS (PARTITION BY block_hash ORDER BY arrival_ns)) GROUP BY ts",
        [scenario])
    try:
        rows = []
        for q, ttl in enumerate(ttls_ns):
            ((covered, held, end),) = con.execute(
                f"SELECT sum(c{q}), sum(h{q}), max(s{q}) FROM {table}").fetchall()
            ((peak,),) = con.execute(
                f"SELECT max(h) FROM (SELECT t, bool_or(a) AS a, sum(sum(d)) OVER (ORDER BY t) AS h FROM ("
                f"SELECT ts AS t, f{q} AS d, true AS a FROM {table} UNION ALL "
                f"SELECT least(ts + {ttl}, {cap}) AS t, -e{q} AS d, false AS a FROM {table} WHERE e{q} > 0) "
                "GROUP BY t) WHERE a").fetchall()
            rows.append(TtlRow(ttl, int(covered), size * int(held), max(1, int(end) - int(first)),
                               _bytes(int(peak), size)))
        return tuple(rows)
    finally:
        con.execute(f"DROP TABLE IF EXISTS {table}")


def curves_out_of_core(con: duckdb.DuckDBPyConnection, scenario: str, *, bytes_per_token: int,
                       rate: float | None, ttls_s: tuple[float, ...], rows: int = CHUNK_ROWS) -> Curves:
    """``scenario``'s `requests` stream read from the lake views on ``con`` in chunks of about
    ``rows`` accesses, its figures summed (``CurvesChain``): O(rows + distinct blocks) in memory."""
    chain = CurvesChain(rate=rate, ttls_s=ttls_s)
    for chunk in requests_read(con, scenario, bytes_per_token, rows=rows):
        chain.add(chunk)
    return chain.done(con, scenario)
