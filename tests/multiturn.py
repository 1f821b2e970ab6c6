"""A generated multi-turn chat trace as `request_blocks` rows: sessions that grow turn by turn.

Each session starts from one of a few shared system prompts; every turn's prompt is the previous
prompt, the previous answer and a new user message, so turns share ever longer prefixes and
most prompts end in a partial block. Block keys are chained hashes of the token ids (the way an
engine keys its prefix cache), so a partial tail has a key of its own and a repeated prompt
repeats its tail's key. Deterministic for a seed.
"""

from __future__ import annotations

import hashlib

import numpy as np
import polars as pl

__all__ = ["multiturn_blocks"]


def _chain(parent: int, tokens: list[int]) -> int:
    digest = hashlib.blake2b(repr((parent, tokens)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _blocks(tokens: list[int], block_size: int) -> list[tuple[int, int]]:
    out, parent = [], 0
    for start in range(0, len(tokens), block_size):
        piece = tokens[start:start + block_size]
        parent = _chain(parent, piece)
        out.append((parent, len(piece)))
    return out


def multiturn_blocks(*, sessions: int = 40, turns: int = 6, block_size: int = 16, systems: int = 3,
                     repeats: int = 5, seed: int = 0, scenario: str = "mt") -> pl.DataFrame:
    """Rows of `request_blocks` (request_id, scenario, arrival_ns, position, block_hash, block_tokens,
    block_size_tokens), sorted by arrival. ``repeats`` prompts are sent twice (a retry), so some
    partial tails repeat too."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 32_000, int(rng.integers(20, 70))).tolist() for _ in range(systems)]
    requests: list[tuple[int, list[int]]] = []
    for s in range(sessions):
        start_ms = int(rng.integers(0, 60_000))
        history = list(prompts[s % systems])
        for t in range(turns):
            history += rng.integers(0, 32_000, int(rng.integers(5, 40))).tolist()  # the user's message
            requests.append((start_ms + t * int(rng.integers(2_000, 9_000)), list(history)))
            history += rng.integers(0, 32_000, int(rng.integers(10, 60))).tolist()  # the answer
    for i in rng.choice(len(requests), size=repeats, replace=False):
        requests.append((requests[i][0] + 500, requests[i][1]))
    rows = []
    for n, (arrival_ms, tokens) in enumerate(sorted(requests, key=lambda r: r[0])):
        for pos, (key, size) in enumerate(_blocks(tokens, block_size)):
            rows.append({"request_id": f"r{n:05d}", "scenario": scenario, "arrival_ns": arrival_ms * 10**6,
                         "position": pos, "block_hash": key, "block_tokens": size,
                         "block_size_tokens": block_size})
    return pl.DataFrame(rows, schema_overrides={"block_hash": pl.UInt64, "position": pl.Int32,
                                                "block_tokens": pl.Int32, "block_size_tokens": pl.Int32})
