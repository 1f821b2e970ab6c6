"""Collector-side hashing: vLLM-compatible chained block hashes, and kvlens's content hash.

vLLM (``vllm/v1/core/kv_cache_utils.py``, FORMATS.md 1.8) keys each full block by
``hash_fn((parent_digest or NONE_HASH, tuple(block_token_ids), extra_keys_or_None))``:

- ``sha256``: ``sha256(pickle.dumps(obj, protocol=HIGHEST))`` (the engine's default);
- ``sha256_cbor``: ``sha256(cbor2.dumps(obj, canonical=True))`` (reproducible anywhere);
- ``NONE_HASH = hash_fn(seed)`` where the seed is ``PYTHONHASHSEED`` when the engine had it
  set, else the fixed string ``"vllm-none-hash"`` (vLLM ≥ the release that added
  ``DEFAULT_NONE_HASH_SEED``; older releases drew 32 random bytes, which nobody can redo);
- extra keys: the LoRA on every block, the cache salt on the first block only. Recent vLLM
  tags them (``("lora", name, path)``, ``("cache_salt", salt)``); older releases put the bare
  strings. ``extra_keys_style`` picks one. Multimodal and prompt-embeds keys are not redone.
- the event form is the digest's last 8 bytes, big-endian, as an unsigned 64-bit int.

``content_hashes`` is kvlens's own chain over token ids alone (no seed, no extra keys, no
model), root parent 0: a block's hash starts from its parent's, takes each token id through
the splitmix64 finalizer (a full 64-bit avalanche per token), then the block length. Not
cryptographic (nothing here is a secret); compiled, since the live collector runs it for every
stored block. Engine events and gateway logs both use it, so the same text under another
cache key still joins.

``token_hashes`` is the same per-block hash NOT chained: every block starts from root parent
0, so a block's value depends on its own token ids alone (equal to ``content_hashes`` of that
block as a root). After an early divergence every later ``content_hash`` differs, but a
repeated block's ``token_hash`` does not: the prompt-hygiene analysis needs that.
"""

from __future__ import annotations

import hashlib
import pickle
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import cbor2
import numba
import numpy as np

from kvlens.errors import ConfigError

__all__ = [
    "ALGOS",
    "DEFAULT_SEED",
    "BlockHash",
    "content_hashes",
    "event_hash",
    "fold_u64",
    "hash_function",
    "none_hash",
    "token_hashes",
    "vllm_block_hashes",
]

DEFAULT_SEED = "vllm-none-hash"
ALGOS = ("sha256", "sha256_cbor")

Algo = Literal["sha256", "sha256_cbor"]
ExtraKeysStyle = Literal["tagged", "bare"]


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {"sha256": _sha256_pickle, "sha256_cbor": _sha256_cbor}


def hash_function(algo: str) -> Callable[[Any], bytes]:
    """vLLM's ``--prefix-caching-hash-algo`` function of that name (sha256 or sha256_cbor)."""
    try:
        return _FUNCTIONS[algo]
    except KeyError:
        raise ConfigError(f"unknown hash algorithm {algo!r}: choose one of {', '.join(ALGOS)}") from None


def none_hash(algo: str = "sha256", seed: str | None = None) -> bytes:
    """The chain root: ``hash_fn(seed)``; seed ``None`` means vLLM's fixed default."""
    return hash_function(algo)(DEFAULT_SEED if seed is None else seed)


U64_MASK = (1 << 64) - 1


def fold_u64(value: int) -> int:
    """A block hash given as a signed (two's complement) or unsigned 64-bit int, as the unsigned 64-bit
    value the lake stores (FORMATS.md section 6, item 4): -1 -> 2**64 - 1. The one folding rule of
    every collector; callers range-check first where the input may not fit 64 bits."""
    return value & U64_MASK


def event_hash(digest: bytes) -> int:
    """A 32-byte digest as vLLM's events carry it: the last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(digest[-8:], "big")


@dataclass(frozen=True)
class BlockHash:
    position: int  # block index in the prompt, from 0
    digest: bytes  # the engine's 32-byte BlockHash
    value: int  # the event form (uint64)


def _extra_keys(position: int, lora_name: str | None, lora_path: str | None, cache_salt: str | None,
                style: ExtraKeysStyle) -> tuple[Any, ...] | None:
    keys: list[Any] = []
    if lora_name is not None:
        keys.append(("lora", lora_name, lora_path) if style == "tagged" else lora_name)
    if cache_salt and position == 0:
        keys.append(("cache_salt", cache_salt) if style == "tagged" else cache_salt)
    return tuple(keys) if keys else None


def vllm_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    algo: str = "sha256",
    seed: str | None = None,
    cache_salt: str | None = None,
    lora_name: str | None = None,
    lora_path: str | None = None,
    extra_keys_style: ExtraKeysStyle = "tagged",
) -> list[BlockHash]:
    """The chained hashes vLLM computes for the full blocks of ``token_ids`` (tail ignored)."""
    if block_size < 1:
        raise ConfigError(f"block size must be >= 1, got {block_size}: give the engine's --block-size")
    fn = hash_function(algo)
    parent = none_hash(algo, seed)
    out = []
    for pos in range(len(token_ids) // block_size):
        block = tuple(int(t) for t in token_ids[pos * block_size:(pos + 1) * block_size])
        parent = fn((parent, block, _extra_keys(pos, lora_name, lora_path, cache_salt, extra_keys_style)))
        out.append(BlockHash(pos, parent, event_hash(parent)))
    return out


@numba.njit(cache=True, inline="always")
def _splitmix(x: np.uint64) -> np.uint64:
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@numba.njit(cache=True)
def _content_chain(tokens: np.ndarray, block_size: int, parent: np.uint64) -> np.ndarray:
    n = tokens.shape[0] // block_size
    out = np.empty(n, np.uint64)
    h = parent
    for b in range(n):
        x = _splitmix(h ^ np.uint64(0x9E3779B97F4A7C15))
        for i in range(b * block_size, (b + 1) * block_size):
            x = _splitmix(x ^ np.uint64(tokens[i]))
        h = _splitmix(x ^ np.uint64(block_size))
        out[b] = h
    return out


@numba.njit(cache=True)
def _token_blocks(tokens: np.ndarray, block_size: int) -> np.ndarray:
    n = tokens.shape[0] // block_size
    out = np.empty(n, np.uint64)
    root = _splitmix(np.uint64(0x9E3779B97F4A7C15))  # the chain's first step with parent 0
    for b in range(n):
        x = root
        for i in range(b * block_size, (b + 1) * block_size):
            x = _splitmix(x ^ np.uint64(tokens[i]))
        out[b] = _splitmix(x ^ np.uint64(block_size))
    return out


def _uint32_tokens(token_ids: Sequence[int]) -> np.ndarray | None:
    try:
        return np.frombuffer(array("I", token_ids), dtype=np.uint32)
    except (OverflowError, TypeError):
        return None


def token_hashes(token_ids: Sequence[int], block_size: int) -> list[int] | None:
    """One uint64 per full block over that block's token ids alone (not chained); None for
    ids that do not fit uint32. A block's value equals ``content_hashes`` of it as a root."""
    tokens = _uint32_tokens(token_ids)
    if tokens is None:
        return None
    if block_size < 1 or len(tokens) < block_size:
        return []
    return _token_blocks(tokens, block_size).tolist()


def content_hashes(token_ids: Sequence[int], block_size: int, parent: int = 0) -> list[int] | None:
    """kvlens's chain over token content alone, one uint64 per full block; None for ids that
    do not fit uint32 (no tokenizer has such a vocabulary: the input is wrong)."""
    try:
        tokens = array("I", token_ids)
    except (OverflowError, TypeError):
        return None
    if block_size < 1 or len(tokens) < block_size:
        return []
    chain = _content_chain(np.frombuffer(tokens, dtype=np.uint32), block_size, np.uint64(parent))
    return chain.tolist()
