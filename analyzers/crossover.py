"""Analyzers: the measured crossover: recompute against load, per prefix length and load path.

DESIGN.md section 1, question 10: "load beats recompute" is a measurement where the GPU probe
calibrated the cost model, and says ``modelled`` where it did not.
"""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl

from kvlens.analyzers.costs import CostModel, LoadPath

__all__ = ["CROSSOVER_TOKENS", "crossover"]

# The grid: 512 .. 131,072 tokens, doubling.
CROSSOVER_TOKENS: tuple[int, ...] = tuple(512 * 2**i for i in range(9))


def crossover(*, costs: CostModel, scenario: str, tokens: Sequence[int] = CROSSOVER_TOKENS) -> pl.DataFrame:
    """Recompute a whole prefix from scratch, or load its KV bytes, per length and path.

    Columns: scenario, device, model, prefix_tokens, kv_bytes, path (local_tier, peer, pool),
    recompute_ms, recompute_label, recompute_extrapolated (outside the probe's measured lengths),
    load_ms (T_remote), load_label, winner (``load`` or ``recompute``). Sorted by prefix_tokens,
    then path.
    """
    rows = []
    for t in tokens:
        nbytes = costs.model.kv_bytes(t)
        rec, rec_label = costs.recompute_ms(t)
        for path in LoadPath:
            load, load_label = costs.remote_ms(nbytes, path)
            rows.append({"scenario": scenario, "device": costs.device_name, "model": costs.model.name,
                         "prefix_tokens": t, "kv_bytes": nbytes, "path": str(path), "recompute_ms": rec,
                         "recompute_label": str(rec_label), "recompute_extrapolated": costs.extrapolated(t),
                         "load_ms": load, "load_label": str(load_label),
                         "winner": "load" if load < rec else "recompute"})
    return pl.DataFrame(rows).sort("prefix_tokens", "path")
