"""Analyzers: warm-up: for each replica start, time to the fleet's steady hit ratio and what a pre-warm buys.

Definitions (DESIGN.md section 1, question 7), every one a parameter:

- **start**: a replica's first request or kv_event (``first_seen``), and every ``cleared``
  event of it (``cleared``); a start's requests are the replica's requests from it until
  its next start. A location without requests (the pool) has no warm-up.
- **hit ratio**: hit tokens over full-block tokens (hit + miss + recomputed_last), a ratio of
  sums. The fleet's **steady ratio** H is that ratio over every request arriving in the second
  half of the scenario (by time).
- **steady**: the first request at which the hit ratio over the replica's last
  ``steady_requests`` requests (since the start) reaches ``steady_fraction`` x H.
  ``steady_after_ns`` is its arrival minus the start; NULL when never reached (warm-up then
  runs to the replica's next start or the end). The **warm-up requests** arrive before it.
- **recomputed in warm-up**: over the warm-up requests, sum(H x full-block tokens - hit
  tokens), floored at 0: the tokens recomputed beyond what the steady level would have.
- **pre-warm**: the ``top_k`` blocks the fleet needed most often over the scenario (at least
  twice; a block hash is chained, so it names a whole prefix and, being needed by every
  request that needs its children, ranks at least as high as they do) loaded before the
  first request. It is chosen in hindsight, as a plan for the next start. ``prewarm_prefixes``
  counts its chains (chosen blocks with no chosen child). Its cost is the fan-out bandwidth
  ``N·W/Δt``: N the starts within ``prewarm_window_ns`` (Δt) of this one, W its bytes.
- **saved**: warm-up blocks with a miss outcome that are in the pre-warm set and whose
  earlier blocks all were hits or in the set; ``saved_ms`` prices them at the scenario's
  measured prefill time per recomputed token (sum of TTFT minus queue over sum of prompt
  minus hit tokens), an upper bound that ignores eviction of pre-warmed blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import polars as pl

from kvlens.analyzers.scans import Scans
from kvlens.schema import HIT_OUTCOMES

__all__ = ["warmup", "warmup_out_of_core"]

_TOKENS = ("hit_tokens", "miss_tokens", "recomputed_last_tokens")
_SCHEMA = {
    "scenario": pl.Utf8, "replica": pl.Utf8, "start_ns": pl.Int64, "start_kind": pl.Utf8,
    "first_request_ns": pl.Int64, "steady_after_ns": pl.Int64, "fleet_hit_ratio": pl.Float64,
    "warmup_requests": pl.Int64, "warmup_recomputed_tokens": pl.Int64, "prewarm_blocks": pl.Int64,
    "prewarm_prefixes": pl.Int64, "prewarm_bytes": pl.Int64, "concurrent_starts": pl.Int64,
    "prewarm_bandwidth_bytes_per_s": pl.Float64, "saved_tokens": pl.Int64, "saved_ms": pl.Float64,
}


def _starts(first_req: pl.DataFrame, kv_events: duckdb.DuckDBPyRelation, scans: Scans) -> pl.DataFrame:
    """The starts (replica, start_ns, start_kind) of the replicas that served requests
    (``first_req``: replica, first_ns: each one's first arrival)."""
    ev = scans.aggregate("warmup.first", "kv_events", kv_events, ["replica", "CAST(kind AS VARCHAR) AS kind"],
                         {"first_ns": ("min(ts_ns)", "min")})
    clears = (scans.aggregate("warmup.clears", "kv_events", kv_events.filter("kind = 'cleared'"),
                              ["replica", "ts_ns"])
              .select(pl.col("replica").cast(pl.Utf8), start_ns="ts_ns", start_kind=pl.lit("cleared")))
    first = (pl.concat([ev.select("replica", "first_ns"), first_req]).group_by("replica")
             .agg(start_ns=pl.col("first_ns").min()).with_columns(start_kind=pl.lit("first_seen")))
    served = first_req["replica"]
    starts = pl.concat([first, clears]).filter(pl.col("replica").is_in(served.implode()))
    # A clear at the very first moment is the same start.
    return starts.sort("replica", "start_ns", "start_kind", descending=[False, False, True]).unique(
        ["replica", "start_ns"], keep="first", maintain_order=True)


def _prewarm(outcomes: pl.DataFrame, top_k: int) -> tuple[pl.DataFrame, int]:
    """The hot set (block_hash, bytes) and its number of chains."""
    counts = (outcomes.group_by("block_hash")
              .agg(needs=pl.len(), position=pl.col("position").min(), bytes=pl.col("bytes").max())
              .filter(pl.col("needs") >= 2))
    # The k largest, then sorted (not every block sorted for them: the blocks needed twice grow with
    # the lake's age, 44k on the whole sample trace; 7.6 ms against 1.8 for the default 64)
    if top_k < counts.height:
        counts = counts.top_k(top_k, by=["needs", "position", "block_hash"], reverse=[False, True, True])
    counts = counts.sort(["needs", "position", "block_hash"], descending=[True, False, False])
    # A chosen block's parent is the block one position before it in a request that needs it; only
    # the rows of chosen blocks can be either side of a chosen pair (no sort of every row).
    rows = (outcomes.filter(pl.col("block_hash").is_in(counts["block_hash"].implode()))
            .select("request_id", "position", "block_hash"))
    parents = rows.join(rows.select("request_id", position=pl.col("position") + 1, parent="block_hash"),
                        on=["request_id", "position"])
    return counts.select("block_hash", "bytes"), counts.height - parents["parent"].n_unique()


def _steady(hit: np.ndarray, need: np.ndarray, target: float, window: int) -> int | None:
    """Index of the first request whose trailing ``window`` requests reach ``target``."""
    if len(hit) < window:
        return None
    h, n = np.cumsum(np.concatenate([[0], hit])), np.cumsum(np.concatenate([[0], need]))
    win_h, win_n = h[window:] - h[:-window], n[window:] - n[:-window]
    ok = np.flatnonzero(win_h >= target * win_n - 1e-9)
    return int(ok[0]) + window - 1 if len(ok) else None


def _saved_blocks(blocks: pl.DataFrame, hot: pl.Series) -> pl.DataFrame:
    """The rows of ``blocks`` (every outcome of each request it holds) that a pre-warm of ``hot``
    would have turned into hits: a miss in the set whose earlier blocks all were hits or in it."""
    blocks = blocks.sort("request_id", "position")
    outcome = pl.col("outcome").cast(pl.Utf8)
    bad = (~(outcome.is_in(HIT_OUTCOMES) | pl.col("block_hash").is_in(hot.implode()))).cast(pl.Int32)
    blocks = blocks.with_columns(before=bad.cum_sum().over("request_id") - bad)
    return blocks.filter(outcome.str.starts_with("miss_") & pl.col("block_hash").is_in(hot.implode())
                         & (pl.col("before") == 0))


def _saved(outcomes: pl.DataFrame, request_ids: pl.Series, hot: pl.Series) -> int:
    blocks = outcomes.filter(pl.col("request_id").is_in(request_ids.implode()))
    return int(_saved_blocks(blocks, hot)["tokens"].cast(pl.Int64).sum())


def _fleet(ledger: pl.DataFrame) -> tuple[float, float]:
    """(steady hit ratio over the second half, measured prefill ms per recomputed token)."""
    need = pl.col("hit_tokens") + pl.col("miss_tokens") + pl.col("recomputed_last_tokens")
    mid = (ledger["arrival_ns"].min() + ledger["arrival_ns"].max()) // 2  # type: ignore[operator]
    late = ledger.filter(pl.col("arrival_ns") >= mid).select(h=pl.col("hit_tokens").sum(), n=need.sum())
    timed = ledger.filter(pl.col("ttft_ms").is_not_null() & pl.col("prompt_tokens").is_not_null()).select(
        ms=(pl.col("ttft_ms") - pl.col("queue_ms").fill_null(0)).sum(),
        tokens=(pl.col("prompt_tokens") - pl.col("hit_tokens")).sum())
    return _fleet_figures(late["h"][0], late["n"][0], timed["ms"][0], timed["tokens"][0])


def _fleet_figures(hit: int, need: int, ms: float, tokens: int) -> tuple[float, float]:
    """(steady ratio, ms per recomputed token) of the second half's ``hit`` and ``need`` tokens and
    the timed requests' prefill ``ms`` over their ``tokens`` (prompt minus hit)."""
    ratio = hit / need if need else 0.0
    per_token = ms / tokens if tokens else 0.0
    return float(ratio), float(per_token or 0.0)


def _check(steady_requests: int, top_k: int, prewarm_window_ns: int) -> None:
    if steady_requests < 1 or top_k < 0 or prewarm_window_ns <= 0:
        raise ValueError("steady_requests >= 1, top_k >= 0 and prewarm_window_ns > 0 are required")


def warmup(*, request_ledger: pl.DataFrame, block_outcomes: pl.DataFrame,
           kv_events: duckdb.DuckDBPyRelation, scenario: str, steady_requests: int = 50,
           steady_fraction: float = 0.9, top_k: int = 64,
           prewarm_window_ns: int = 60_000_000_000, scans: Scans | None = None) -> pl.DataFrame:
    """One row per replica start of ``scenario``: time to steady, tokens lost, what a pre-warm buys.

    The frames and ``kv_events`` are the scenario's (its ledger, its outcomes, its rows).

    Columns: scenario, replica, start_ns (ns), start_kind (first_seen or cleared),
    first_request_ns (ns), steady_after_ns (ns after the start; NULL if never), fleet_hit_ratio
    (H), warmup_requests, warmup_recomputed_tokens, prewarm_blocks, prewarm_prefixes,
    prewarm_bytes, concurrent_starts (N), prewarm_bandwidth_bytes_per_s (N·W/Δt), saved_tokens,
    saved_ms. Sorted by replica, start. ``scans``: continues the events' first times and clears
    from the previous run's (analyzers/scans.py).
    """
    _check(steady_requests, top_k, prewarm_window_ns)
    ledger = (request_ledger.with_columns(pl.col("replica").cast(pl.Utf8))
              .filter(pl.col("replica").fill_null("") != "")
              .with_columns(pl.col(c).fill_null(0).cast(pl.Int64) for c in _TOKENS)
              .with_columns(pl.col("prompt_tokens").cast(pl.Int64))
              .sort("arrival_ns", "request_id"))
    if ledger.height == 0:
        return pl.DataFrame(schema=_SCHEMA)
    ratio, ms_per_token = _fleet(ledger)
    hot, prefixes = _prewarm(block_outcomes, top_k)
    first_req = ledger.group_by("replica").agg(first_ns=pl.col("arrival_ns").min())
    starts = _starts(first_req, kv_events, scans or Scans({"kv_events": (kv_events, "ts_ns")})).with_columns(
        next_ns=pl.col("start_ns").shift(-1).over("replica"))
    start_ns = starts["start_ns"].to_numpy()
    found = []
    for rep, start, kind, nxt in starts.select("replica", "start_ns", "start_kind", "next_ns").iter_rows():
        seg = ledger.filter((pl.col("replica") == rep) & (pl.col("arrival_ns") >= start)
                            & (pl.col("arrival_ns") < (nxt if nxt is not None else np.iinfo(np.int64).max)))
        if seg.height == 0:
            continue
        need = (seg["hit_tokens"] + seg["miss_tokens"] + seg["recomputed_last_tokens"]).to_numpy()
        at = _steady(seg["hit_tokens"].to_numpy(), need, steady_fraction * ratio, steady_requests)
        found.append((rep, start, kind, seg, need, at, seg if at is None else seg.head(at)))
    # the warm-up requests' blocks, picked from the outcomes once for every start (the outcomes
    # grow with the lake's age; the warm-up requests do not)
    warming = (pl.concat([warm["request_id"] for *_, warm in found]) if found
               else pl.Series([], dtype=pl.String))
    warm_blocks = block_outcomes.filter(pl.col("request_id").is_in(warming.implode()))
    fleet = _Fleet(scenario, ratio, ms_per_token, hot, prefixes, start_ns, prewarm_window_ns)
    rows = [fleet.row(_Warming(rep, start, kind, int(seg["arrival_ns"][0]),
                               None if at is None else int(seg["arrival_ns"][at]), warm.height,
                               int(need[: warm.height].sum()), int(warm["hit_tokens"].sum()),
                               _saved(warm_blocks, warm["request_id"], hot["block_hash"])))
            for rep, start, kind, seg, need, at, warm in found]
    return pl.DataFrame(rows, schema=_SCHEMA).sort("replica", "start_ns")


@dataclass(frozen=True)
class _Warming:
    """One start's warm-up, reduced: its first request, the arrival of the request at which it
    was steady (None: never), and its warm-up requests' count, full-block and hit tokens and saved
    tokens."""

    replica: str
    start_ns: int
    start_kind: str
    first_request_ns: int
    steady_ns: int | None
    requests: int
    need_tokens: int
    hit_tokens: int
    saved_tokens: int


@dataclass(frozen=True)
class _Fleet:
    """What every start's row shares: the steady ratio, the prefill time per token, the hot set
    and its chains, and every start's time (for the starts within the pre-warm window)."""

    scenario: str
    ratio: float
    ms_per_token: float
    hot: pl.DataFrame
    prefixes: int
    start_ns: np.ndarray
    window_ns: int

    def row(self, w: _Warming) -> dict[str, object]:
        """The warmup row of start ``w``."""
        excess = self.ratio * float(w.need_tokens) - float(w.hit_tokens)
        n_starts = int(np.sum(np.abs(self.start_ns - w.start_ns) < self.window_ns))
        w_bytes = int(self.hot["bytes"].sum())
        return {
            "replica": w.replica, "start_ns": w.start_ns, "start_kind": w.start_kind,
            "first_request_ns": w.first_request_ns,
            "steady_after_ns": None if w.steady_ns is None else w.steady_ns - w.start_ns,
            "warmup_requests": w.requests, "warmup_recomputed_tokens": max(round(excess), 0),
            "prewarm_blocks": self.hot.height, "prewarm_prefixes": self.prefixes, "prewarm_bytes": w_bytes,
            "concurrent_starts": n_starts,
            "prewarm_bandwidth_bytes_per_s": n_starts * w_bytes / (self.window_ns / 1e9),
            "saved_tokens": w.saved_tokens, "saved_ms": w.saved_tokens * self.ms_per_token,
            "scenario": self.scenario, "fleet_hit_ratio": self.ratio}


# Out of core: the warm-up blocks in memory at once (one partition of them, by request).
_ROWS_PER_PARTITION = 2_000_000
_EPS = 1e-9  # ``_steady``'s tolerance
_BATCH = 1 << 17  # rows of the request ledger read at once


def warmup_out_of_core(con: duckdb.DuckDBPyConnection, scenario: str, *, work: Path, partitions: int,
                       steady_requests: int = 50, steady_fraction: float = 0.9, top_k: int = 64,
                       prewarm_window_ns: int = 60_000_000_000) -> pl.DataFrame:
    """``warmup``'s rows of ``scenario``, out of core (``kvlens analyze --out-of-core``, issue 17):
    from the ``request_ledger`` and ``block_outcomes`` rows in the analysis DB on ``con`` and its
    lake view ``kv_events``, with DuckDB doing every pass over them (it spills past its memory
    limit).

    - the fleet's steady ratio and the timed requests' token sums are SQL sums (exact); the
      prefill milliseconds are summed exactly rounded (``math.fsum``) as the request ledger
      streams by. ``warmup`` sums them in polars, whose result depends on how its frame is cut
      into chunks (by its filters, on threads), which cannot be reproduced here: ``saved_ms``
      (through the prefill time per token) may differ in its last bits, within 1e-12 relative;
      every other column is exact;
    - the hot set is a DuckDB group-by of the outcomes by block hash, its top ``top_k``, and its
      chains a self-join of the hot blocks' rows;
    - each request is placed at its start (an as-of join on the starts ``_starts`` gives), and
      the trailing sums of ``_steady`` are window sums, compared in the same float arithmetic;
    - the warm-up requests' outcomes are written in partitions by request, and each partition is
      given to ``_saved_blocks`` (a request's blocks are all in one partition, so its sums add up).

    Exact: the rows ``warmup`` gives (tests/test_ooc_warmup.py), ``saved_ms`` within 1e-12
    relative. Memory in Python: the starts (and the clears), the hot set, a batch of the request
    ledger's times, and one partition of the warm-up requests' outcomes (at most about
    ``_ROWS_PER_PARTITION`` rows; ``partitions`` of them at least when there are as many rows):
    nothing per request or per block access of the scenario. ``work``: a directory for the spill
    files.
    """
    _check(steady_requests, top_k, prewarm_window_ns)
    ledger = f"""(SELECT request_id, replica, arrival_ns, prompt_tokens, ttft_ms, queue_ms,
                         coalesce(hit_tokens, 0) AS hit,
                         coalesce(hit_tokens, 0) + coalesce(miss_tokens, 0)
                         + coalesce(recomputed_last_tokens, 0) AS need
                  FROM request_ledger WHERE scenario = {_quoted(scenario)} AND coalesce(replica, '') <> '')"""
    count, lo, hi = _one(con, f"SELECT count(*), min(arrival_ns), max(arrival_ns) FROM {ledger}")
    if not count:
        return pl.DataFrame(schema=_SCHEMA)
    h, n = _one(con, f"SELECT CAST(coalesce(sum(hit), 0) AS BIGINT), CAST(coalesce(sum(need), 0) AS BIGINT) "
                     f"FROM {ledger} WHERE arrival_ns >= {(lo + hi) // 2}")
    timed = f"{ledger} WHERE ttft_ms IS NOT NULL AND prompt_tokens IS NOT NULL"
    (tokens,) = _one(con, f"SELECT CAST(coalesce(sum(prompt_tokens - hit), 0) AS BIGINT) FROM {timed}")
    # each request's prefill time as ``_fleet`` computes it, summed exactly rounded as it streams
    reader = con.sql(f"SELECT ttft_ms - coalesce(queue_ms, 0) AS ms FROM {timed}").to_arrow_reader(_BATCH)
    ms = math.fsum(v for batch in reader for v in batch.column(0).to_numpy())
    ratio, ms_per_token = _fleet_figures(h, n, ms, tokens)
    hot, prefixes = _hot_set(con, scenario, top_k)
    first_req = con.sql(f"SELECT replica, min(arrival_ns) AS first_ns FROM {ledger} GROUP BY replica").pl()
    events = con.table("kv_events").filter(duckdb.ColumnExpression("scenario")
                                           == duckdb.ConstantExpression(scenario))
    starts = _starts(first_req.cast({"replica": pl.Utf8, "first_ns": pl.Int64}), events,
                     Scans({"kv_events": (events, "ts_ns")})).with_row_index("sid")
    starts.write_parquet(work / "starts.parquet")
    # Each request at its start, in order, with the trailing sums of ``_steady``'s window.
    con.execute(f"""COPY (SELECT s.sid, l.request_id, l.arrival_ns, l.hit, l.need,
                                 row_number() OVER (w) - 1 AS rn,
                                 sum(l.hit) OVER (w ROWS {steady_requests - 1} PRECEDING) AS win_h,
                                 sum(l.need) OVER (w ROWS {steady_requests - 1} PRECEDING) AS win_n
                          FROM {ledger} l ASOF JOIN {_file(work / 'starts.parquet')} s
                            ON l.replica = s.replica AND l.arrival_ns >= s.start_ns
                          WINDOW w AS (PARTITION BY s.sid ORDER BY l.arrival_ns, l.request_id))
                    TO {_file(work / 'requests.parquet')} (FORMAT parquet)""")
    seg = _file(work / "requests.parquet")
    steady = con.sql(f"""
        WITH steady AS (SELECT sid, min(rn) FILTER (WHERE rn >= {steady_requests - 1}
                                   AND CAST(win_h AS DOUBLE) >= $target * CAST(win_n AS DOUBLE) - $eps
                                   ) AS steady_rn
                        FROM {seg} GROUP BY sid),
             warm AS (SELECT r.*, a.steady_rn, a.steady_rn IS NULL OR r.rn < a.steady_rn AS warm
                      FROM {seg} r JOIN steady a USING (sid))
        SELECT sid, min(arrival_ns) AS first_ns, max(arrival_ns) FILTER (WHERE rn = steady_rn) AS steady_ns,
               count(*) FILTER (WHERE warm) AS warm_n,
               CAST(coalesce(sum(need) FILTER (WHERE warm), 0) AS BIGINT) AS warm_need,
               CAST(coalesce(sum(hit) FILTER (WHERE warm), 0) AS BIGINT) AS warm_hit,
               any_value(steady_rn) AS steady_rn
        FROM warm GROUP BY sid ORDER BY sid""", params={"target": steady_fraction * ratio, "eps": _EPS}).pl()
    saved = (_saved_out_of_core(con, scenario, steady.select("sid", "steady_rn"), hot["block_hash"],
                                work=work, partitions=partitions) if hot.height else {})
    fleet = _Fleet(scenario, ratio, ms_per_token, hot, prefixes, starts["start_ns"].to_numpy(),
                   prewarm_window_ns)
    rows = []
    for r in steady.join(starts, on="sid").iter_rows(named=True):
        rows.append(fleet.row(_Warming(r["replica"], r["start_ns"], r["start_kind"], r["first_ns"],
                                       r["steady_ns"], r["warm_n"], r["warm_need"], r["warm_hit"],
                                       saved.get(r["sid"], 0))))
    return pl.DataFrame(rows, schema=_SCHEMA).sort("replica", "start_ns")


def _hot_set(con: duckdb.DuckDBPyConnection, scenario: str, top_k: int) -> tuple[pl.DataFrame, int]:
    """``_prewarm`` of the scenario's outcomes in the DB: the hot set (block_hash, bytes) and its
    number of chains, grouped and joined by DuckDB."""
    outcomes = f"(SELECT * FROM block_outcomes WHERE scenario = {_quoted(scenario)})"
    hot = con.sql(f"""SELECT block_hash, max(bytes) AS bytes FROM {outcomes}
                          GROUP BY block_hash HAVING count(*) >= 2
                          ORDER BY count(*) DESC, min(position), block_hash LIMIT {int(top_k)}""").pl()
    if hot.is_empty():
        return hot, 0
    (parents,) = _one(con, f"""
        WITH hot AS (SELECT request_id, position, block_hash FROM {outcomes}
                     WHERE block_hash IN (SELECT block_hash FROM hot_frame))
        SELECT count(DISTINCT p.block_hash) FROM hot c JOIN hot p
          ON p.request_id = c.request_id AND p.position + 1 = c.position""",
                         {"hot_frame": hot.select("block_hash")})
    return hot, hot.height - parents


def _saved_out_of_core(con: duckdb.DuckDBPyConnection, scenario: str, steady: pl.DataFrame, hot: pl.Series,
                       *, work: Path, partitions: int) -> dict[int, int]:
    """Per start (``sid``): its saved tokens, ``_saved_blocks`` of its warm-up requests' outcomes
    (those before ``steady_rn``, every one where None), read one partition by request at a time."""
    steady.write_parquet(work / "steady.parquet")
    warm = f"""(SELECT r.request_id, r.sid FROM {_file(work / 'requests.parquet')} r
                JOIN {_file(work / 'steady.parquet')} s USING (sid)
                WHERE s.steady_rn IS NULL OR r.rn < s.steady_rn)"""
    blocks = f"""SELECT o.request_id, o.position, o.block_hash, CAST(o.outcome AS VARCHAR) AS outcome,
                        o.tokens, w.sid
                 FROM block_outcomes o JOIN {warm} w USING (request_id)
                 WHERE o.scenario = {_quoted(scenario)}"""
    (rows,) = _one(con, f"SELECT count(*) FROM ({blocks})")
    if not rows:
        return {}
    k = max(math.ceil(rows / _ROWS_PER_PARTITION), min(partitions, rows))
    con.execute(f"COPY (SELECT *, hash(request_id) % {k} AS p FROM ({blocks})) "
                f"TO {_file(work / 'warm_blocks')} (FORMAT parquet, PARTITION_BY (p))")
    saved: dict[int, int] = {}
    for part in sorted((work / "warm_blocks").glob("p=*")):
        got = (_saved_blocks(pl.read_parquet(part / "*.parquet", hive_partitioning=False), hot)
               .group_by("sid").agg(tokens=pl.col("tokens").cast(pl.Int64).sum()))
        for sid, tokens in got.iter_rows():
            saved[sid] = saved.get(sid, 0) + tokens
    return saved


def _one(con: duckdb.DuckDBPyConnection, sql: str, frames: dict[str, pl.DataFrame] | None = None
         ) -> tuple[Any, ...]:
    """The one row of ``sql`` (``frames``: polars frames it reads by name)."""
    for name, frame in (frames or {}).items():
        con.register(name, frame)
    try:
        (row,) = con.execute(sql).fetchall()
    finally:
        for name in frames or {}:
            con.unregister(name)
    return row


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _file(path: Path) -> str:
    return _quoted(str(path))
