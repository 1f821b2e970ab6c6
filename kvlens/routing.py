"""The spine's routing rules: each policy's choice defined once, for the simulator and the gateway.

The what-if simulator (analyzers/sim_config.py, analyzers/scheduler.py) and ``kvlens gateway``
(collector/gateway_router.py) route with the same rules, so an operator can run live the policy a
what-if recommended:

- ``session_affinity``: a session goes to ``crc32(session) mod N``;
- ``prefix_hash`` (and ``session_affinity`` without a session): the crc32 of the prompt's first
  ``PREFIX_BLOCKS`` full-block hashes (uint64 little-endian bytes) mod N; a prompt without a full
  block is placed by the crc32 of its request id. One shared system-prompt block alone would send
  every request to one replica, hence several blocks;
- ``cache_aware``: the replica holding the longest resident prefix of the prompt's full blocks
  (ties: the less loaded, then the lower index), unless it covers under ``CACHE_THRESHOLD`` of
  them (SGLang's cache-aware router's match-rate threshold); then the least loaded. With a load
  factor K: when the chosen replica has more than K x the mean in-flight requests, the least
  loaded instead.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

__all__ = ["CACHE_THRESHOLD", "PREFIX_BLOCKS", "cache_aware_choice", "least_loaded", "overloaded",
           "prefix_replica", "session_replica"]

PREFIX_BLOCKS = 4
CACHE_THRESHOLD = 0.5


def session_replica(session: str, n: int) -> int:
    """session_affinity's replica for a named session."""
    return zlib.crc32(str(session).encode()) % n


def prefix_replica(full_hashes: Sequence[int], request_id: str, n: int,
                   prefix_blocks: int = PREFIX_BLOCKS) -> int:
    """prefix_hash's replica: the crc32 of the first ``prefix_blocks`` full-block hashes."""
    head = list(full_hashes[:prefix_blocks]) or [zlib.crc32(request_id.encode())]
    return zlib.crc32(np.array(head, dtype=np.uint64).tobytes()) % n


def least_loaded(loads: Sequence[int]) -> int:
    """The lowest index among the replicas with the fewest requests in flight."""
    return min(range(len(loads)), key=lambda r: (loads[r], r))


def cache_aware_choice(matched: Sequence[int], loads: Sequence[int], n_full: int, *,
                       threshold: float = CACHE_THRESHOLD,
                       load_factor: float | None = None) -> tuple[int, str]:
    """(replica, reason) for cache_aware: ``matched[r]`` is replica r's resident prefix in full blocks.

    The same rule as the simulator's compiled ``_route`` (analyzers/scheduler.py), written for one
    request at a time; reasons: ``longest_prefix``, ``below_threshold``, ``load_fallback``.
    """
    least = least_loaded(loads)
    best, bm, bl = least, -1, 0
    for r, m in enumerate(matched):
        if m > bm or (m == bm and -loads[r] > bl):
            best, bm, bl = r, m, -loads[r]
    reason = "longest_prefix"
    if n_full == 0 or bm < threshold * n_full:
        best, reason = least, "below_threshold"
    over = overloaded(loads, best, load_factor)
    if over:
        return least, "load_fallback"
    return best, reason


def overloaded(loads: Sequence[int], chosen: int, load_factor: float | None) -> bool:
    """The load fallback's test: the chosen replica has more than ``load_factor`` x the mean in flight."""
    if not load_factor or not loads:
        return False
    mean = sum(loads) / len(loads)
    return mean > 0 and loads[chosen] > load_factor * mean
