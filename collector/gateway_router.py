"""Collector (kvlens gateway): which replica serves a request, and why, with the simulator's policies.

The rules are kvlens/routing.py's, the ones ``kvlens simulate --routing`` replays, so a policy
a what-if recommended runs live unchanged. Every decision carries its reason:

- ``round_robin``, ``random`` (seeded), ``prefix_hash``: the policy's name;
- ``session_affinity``: ``session`` (the session's replica), or ``prefix_hash`` for a request
  without a session (as the simulator does);
- ``cache_aware``: ``longest_prefix`` (the replica holding the longest resident prefix, at least
  the match threshold of the prompt's full blocks), ``below_threshold`` (shorter: the least
  loaded) or ``load_fallback`` (``--load-factor K``: the chosen replica had more than K x the mean
  in-flight requests; the least loaded instead). The simulator applies the load fallback to
  ``cache_aware`` only, and so does the gateway.

In-flight counts are the gateway's own: ``begin`` when a request is forwarded, ``end`` when its
answer is done.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvlens.errors import ConfigError
from kvlens.routing import CACHE_THRESHOLD, cache_aware_choice, prefix_replica, session_replica
from kvlens.schema import RoutingPolicy

__all__ = ["POLICIES", "Decision", "Router"]

POLICIES = tuple(p.value for p in RoutingPolicy if p != RoutingPolicy.RECORDED)


@dataclass(frozen=True)
class Decision:
    replica: int
    reason: str
    matched_blocks: int | None = None  # cache_aware: the chosen replica's resident prefix


class Router:
    """Picks a replica index for each request; ``matched(r, hashes)`` reads replica r's resident prefix."""

    def __init__(self, n: int, policy: str, *, load_factor: float | None = None, seed: int = 0,
                 matched: Callable[[int, Sequence[int]], int] | None = None,
                 threshold: float = CACHE_THRESHOLD) -> None:
        if policy not in POLICIES:
            raise ConfigError(f"--routing {policy!r} is not one of {', '.join(POLICIES)}")
        if load_factor is not None and (policy != RoutingPolicy.CACHE_AWARE or load_factor <= 0):
            raise ConfigError("--load-factor is cache_aware's load fallback and must be positive: "
                              "give it with --routing cache_aware")
        if policy == RoutingPolicy.CACHE_AWARE and matched is None:
            raise ConfigError("cache_aware routing needs the replicas' KV-event streams: give each "
                              "[[fleet.replicas]] its endpoint")
        self.n, self.policy, self.load_factor, self.threshold = n, policy, load_factor, threshold
        self.in_flight = [0] * n
        self._matched = matched
        self._rng = random.Random(seed)
        self._next = 0
        self._lock = threading.Lock()

    def choose(self, *, request_id: str, session: str | None,
               hashes: Callable[[int], Sequence[int]]) -> Decision:
        """The decision for one request; ``hashes(r)``: its full-block keys as replica r computes them."""
        with self._lock:
            if self.policy == RoutingPolicy.ROUND_ROBIN:
                r, self._next = self._next, (self._next + 1) % self.n
                return Decision(r, "round_robin")
            if self.policy == RoutingPolicy.RANDOM:
                return Decision(self._rng.randrange(self.n), "random")
            if self.policy == RoutingPolicy.SESSION_AFFINITY and session:
                return Decision(session_replica(session, self.n), "session")
            if self.policy != RoutingPolicy.CACHE_AWARE:
                return Decision(prefix_replica(hashes(0), request_id, self.n), "prefix_hash")
            return self._cache_aware(hashes)

    def _cache_aware(self, hashes: Callable[[int], Sequence[int]]) -> Decision:
        assert self._matched is not None
        per = [hashes(r) for r in range(self.n)]
        matched = [self._matched(r, per[r]) for r in range(self.n)]
        r, reason = cache_aware_choice(matched, self.in_flight, len(per[0]), threshold=self.threshold,
                                       load_factor=self.load_factor)
        return Decision(r, reason, matched[r])

    def begin(self, replica: int) -> None:
        with self._lock:
            self.in_flight[replica] += 1

    def end(self, replica: int) -> None:
        with self._lock:
            self.in_flight[replica] -= 1
