"""Sample data: a synthetic multi-turn chat service as a Mooncake-format trace (arrivals, lengths, blocks).

Sessions start as a Poisson process; each opens with one of a few shared system prompts and
runs several turns, a think time apart. A turn's prompt is the whole conversation so far:
the previous prompt, the previous answer, and a new user message. Block ids are 512-token
prefix-chained, as in the Mooncake trace: two prompts share an id at a position exactly when
their tokens up to the end of that block are the same (a shared system prompt across
sessions; the conversation so far within one). Ids are remapped to integers in order of first
appearance. Deterministic for a seed.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BLOCK_TOKENS", "MultiTurn", "write_multiturn_trace"]

BLOCK_TOKENS = 512


@dataclass(frozen=True)
class MultiTurn:
    sessions: int = 800
    duration_s: float = 1800.0
    system_prompts: int = 8
    system_tokens: tuple[int, int] = (300, 1500)
    turns: tuple[int, int] = (4, 16)
    think_s: float = 30.0  # mean time between a session's turns (exponential)
    user_tokens: tuple[int, int] = (200, 2500)
    answer_tokens: tuple[int, int] = (50, 600)


def _block_ids(segments: list[tuple[str, int]], length: int, ids: dict[bytes, int]) -> list[int]:
    """Prefix-chained ids of ``ceil(length / 512)`` blocks over the conversation's segments."""
    out = []
    digest = hashlib.sha256()
    seg, used, pos = 0, 0, 0  # segment index, tokens of it consumed, tokens so far
    for start in range(0, length, BLOCK_TOKENS):
        end = min(start + BLOCK_TOKENS, length)
        while pos < end:
            name, size = segments[seg]
            take = min(size - used, end - pos)
            digest.update(f"{name}:{used}:{take};".encode())
            used, pos = used + take, pos + take
            if used == size:
                seg, used = seg + 1, 0
        key = digest.copy().digest()
        out.append(ids.setdefault(key, len(ids)))
    return out


def write_multiturn_trace(path: Path, *, seed: int = 0, spec: MultiTurn = MultiTurn()) -> Path:
    """Write the trace (one JSON line per request, in arrival order) to ``path``."""
    rng = random.Random(seed)
    systems = [rng.randrange(*spec.system_tokens) for _ in range(spec.system_prompts)]
    rows: list[tuple[float, int, int, list[int]]] = []
    ids: dict[bytes, int] = {}
    for s in range(spec.sessions):
        t = rng.uniform(0, spec.duration_s)
        k = rng.randrange(spec.system_prompts)
        segments: list[tuple[str, int]] = [(f"sys{k}", systems[k])]
        for turn in range(rng.randint(*spec.turns)):
            segments.append((f"s{s}u{turn}", rng.randrange(*spec.user_tokens)))
            length = sum(size for _n, size in segments)
            answer = rng.randrange(*spec.answer_tokens)
            rows.append((t, length, answer, _block_ids(segments, length, ids)))
            segments.append((f"s{s}a{turn}", answer))
            t += rng.expovariate(1 / spec.think_s)
    rows.sort(key=lambda r: r[0])
    with open(path, "w") as f:
        for t, length, answer, blocks in rows:
            f.write(json.dumps({"timestamp": int(t * 1000), "input_length": length, "output_length": answer,
                                "hash_ids": blocks}) + "\n")
    return path
