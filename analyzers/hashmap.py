"""Open-addressing int64 -> int64 tables for the compiled kernels (the ledger's replay).

A table is one int64 array: per slot a key, its value + 1 (0: an empty slot) and its place in the
order keys were added, side by side, so a probe costs one cache line; its last row counts the
keys. The capacity is a power of two at least twice the keys it is made for (linear probing stays
short), and a key is never removed. The replay's maps of block hash to row and of content hash to
namespace only grow, and their largest size is known before the replay starts (one entry per
stored event at most): a table is sized once. ``items`` lists a table in the order its keys were
added, as a dict does: a continued replay's saved state is the whole replay's, array for array.

Against numba's typed ``Dict`` (measured here, a replay continued from a state of 150k rows and
141k contents over 100k events and 55k look-ups, fastest of 7): 56 to 63 ms against 68 to 78 ms.
What is left of it is memory-bound: filling tables of that size from a saved state costs about
30 ms either way (random slots in arrays of several MB).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["get", "items", "mix64", "put", "table", "table_of"]


@njit(cache=True, inline="always")
def mix64(x: np.uint64) -> np.uint64:
    """The splitmix64 finalizer: spreads sequential ids (Mooncake's are small integers) over 64 bits."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@njit(cache=True)
def table(keys: int) -> np.ndarray:
    """An empty table with room for ``keys`` keys."""
    capacity = 16
    while capacity < 2 * keys:
        capacity *= 2
    return np.zeros((capacity + 1, 3), np.int64)  # (the last row: the count of keys)


@njit(cache=True, inline="always")
def _slot(t: np.ndarray, key: int) -> np.int64:
    """The slot holding ``key``, or the empty one where it goes."""
    mask = t.shape[0] - 2
    h = np.int64(mix64(np.uint64(key)) & np.uint64(mask))
    while t[h, 1] != 0 and t[h, 0] != key:
        h = (h + 1) & mask
    return h


@njit(cache=True, inline="always")
def get(t: np.ndarray, key: int) -> int:
    """``key``'s value, or -1 when it has none (values are at least 0)."""
    return t[_slot(t, key), 1] - 1


@njit(cache=True, inline="always")
def put(t: np.ndarray, key: int, value: int) -> None:
    """Set ``key``'s value (at least 0); the table must have room (``table``)."""
    h = _slot(t, key)
    if t[h, 1] == 0:
        t[h, 0] = key
        t[h, 2] = t[-1, 0]
        t[-1, 0] += 1
    t[h, 1] = value + 1


@njit(cache=True)
def table_of(keys: np.ndarray, values: np.ndarray, room: int) -> np.ndarray:
    """A table of ``keys`` and their ``values`` (added in that order), with room for ``room`` more keys."""
    t = table(keys.shape[0] + room)
    for i in range(keys.shape[0]):
        put(t, keys[i], values[i])
    return t


@njit(cache=True)
def items(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The keys and values of a table, in the order the keys were added."""
    n = t[-1, 0]
    keys, values = np.empty(n, np.int64), np.empty(n, np.int64)
    for h in range(t.shape[0] - 1):
        if t[h, 1] != 0:
            keys[t[h, 2]], values[t[h, 2]] = t[h, 0], t[h, 1] - 1
    return keys, values
