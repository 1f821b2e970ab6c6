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

import duckdb
import numpy as np
import polars as pl

from kvlens.analyzers.scans import Scans
from kvlens.schema import HIT_OUTCOMES

__all__ = ["warmup"]

_TOKENS = ("hit_tokens", "miss_tokens", "recomputed_last_tokens")
_SCHEMA = {
    "scenario": pl.Utf8, "replica": pl.Utf8, "start_ns": pl.Int64, "start_kind": pl.Utf8,
    "first_request_ns": pl.Int64, "steady_after_ns": pl.Int64, "fleet_hit_ratio": pl.Float64,
    "warmup_requests": pl.Int64, "warmup_recomputed_tokens": pl.Int64, "prewarm_blocks": pl.Int64,
    "prewarm_prefixes": pl.Int64, "prewarm_bytes": pl.Int64, "concurrent_starts": pl.Int64,
    "prewarm_bandwidth_bytes_per_s": pl.Float64, "saved_tokens": pl.Int64, "saved_ms": pl.Float64,
}


def _starts(ledger: pl.DataFrame, kv_events: duckdb.DuckDBPyRelation, scans: Scans) -> pl.DataFrame:
    ev = scans.aggregate("warmup.first", "kv_events", kv_events, ["replica", "CAST(kind AS VARCHAR) AS kind"],
                         {"first_ns": ("min(ts_ns)", "min")})
    clears = (scans.aggregate("warmup.clears", "kv_events", kv_events.filter("kind = 'cleared'"),
                              ["replica", "ts_ns"])
              .select(pl.col("replica").cast(pl.Utf8), start_ns="ts_ns", start_kind=pl.lit("cleared")))
    first_req = ledger.group_by("replica").agg(first_ns=pl.col("arrival_ns").min())
    first = (pl.concat([ev.select("replica", "first_ns"), first_req]).group_by("replica")
             .agg(start_ns=pl.col("first_ns").min()).with_columns(start_kind=pl.lit("first_seen")))
    served = ledger["replica"].unique()
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


def _saved(outcomes: pl.DataFrame, request_ids: pl.Series, hot: pl.Series) -> int:
    blocks = outcomes.filter(pl.col("request_id").is_in(request_ids.implode())).sort("request_id", "position")
    outcome = pl.col("outcome").cast(pl.Utf8)
    bad = (~(outcome.is_in(HIT_OUTCOMES) | pl.col("block_hash").is_in(hot.implode()))).cast(pl.Int32)
    blocks = blocks.with_columns(before=bad.cum_sum().over("request_id") - bad)
    saved = blocks.filter(outcome.str.starts_with("miss_") & pl.col("block_hash").is_in(hot.implode())
                          & (pl.col("before") == 0))
    return int(saved["tokens"].cast(pl.Int64).sum())


def _fleet(ledger: pl.DataFrame) -> tuple[float, float]:
    """(steady hit ratio over the second half, measured prefill ms per recomputed token)."""
    need = pl.col("hit_tokens") + pl.col("miss_tokens") + pl.col("recomputed_last_tokens")
    mid = (ledger["arrival_ns"].min() + ledger["arrival_ns"].max()) // 2  # type: ignore[operator]
    late = ledger.filter(pl.col("arrival_ns") >= mid).select(h=pl.col("hit_tokens").sum(), n=need.sum())
    ratio = late["h"][0] / late["n"][0] if late["n"][0] else 0.0
    timed = ledger.filter(pl.col("ttft_ms").is_not_null() & pl.col("prompt_tokens").is_not_null()).select(
        ms=(pl.col("ttft_ms") - pl.col("queue_ms").fill_null(0)).sum(),
        tokens=(pl.col("prompt_tokens") - pl.col("hit_tokens")).sum())
    per_token = timed["ms"][0] / timed["tokens"][0] if timed["tokens"][0] else 0.0
    return float(ratio), float(per_token or 0.0)


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
    if steady_requests < 1 or top_k < 0 or prewarm_window_ns <= 0:
        raise ValueError("steady_requests >= 1, top_k >= 0 and prewarm_window_ns > 0 are required")
    ledger = (request_ledger.with_columns(pl.col("replica").cast(pl.Utf8))
              .filter(pl.col("replica").fill_null("") != "")
              .with_columns(pl.col(c).fill_null(0).cast(pl.Int64) for c in _TOKENS)
              .with_columns(pl.col("prompt_tokens").cast(pl.Int64))
              .sort("arrival_ns", "request_id"))
    if ledger.height == 0:
        return pl.DataFrame(schema=_SCHEMA)
    ratio, ms_per_token = _fleet(ledger)
    hot, prefixes = _prewarm(block_outcomes, top_k)
    starts = _starts(ledger, kv_events, scans or Scans({"kv_events": (kv_events, "ts_ns")})).with_columns(
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
    rows = []
    for rep, start, kind, seg, need, at, warm in found:
        excess = ratio * float(need[: warm.height].sum()) - float(warm["hit_tokens"].sum())
        saved = _saved(warm_blocks, warm["request_id"], hot["block_hash"])
        n_starts = int(np.sum(np.abs(start_ns - start) < prewarm_window_ns))
        w_bytes = int(hot["bytes"].sum())
        rows.append({
            "replica": rep, "start_ns": start, "start_kind": kind, "first_request_ns": seg["arrival_ns"][0],
            "steady_after_ns": None if at is None else int(seg["arrival_ns"][at]) - start,
            "warmup_requests": warm.height, "warmup_recomputed_tokens": max(round(excess), 0),
            "prewarm_blocks": hot.height, "prewarm_prefixes": prefixes, "prewarm_bytes": w_bytes,
            "concurrent_starts": n_starts,
            "prewarm_bandwidth_bytes_per_s": n_starts * w_bytes / (prewarm_window_ns / 1e9),
            "saved_tokens": saved, "saved_ms": saved * ms_per_token,
            "scenario": scenario, "fleet_hit_ratio": ratio})
    return pl.DataFrame(rows, schema=_SCHEMA).sort("replica", "start_ns")
