"""Analyzers: vLLM's GPU prefix cache, compiled: the block pool of every simulated replica.

The simulator's KV-cache model (``kvlens simulate --engine vllm``), rule for rule as vLLM 0.32.0
keeps it (paths under ``vllm/v1/core/``):

- ``--num-gpu-blocks-override N`` makes N blocks; block 0 is the null block, taken out of
  the free queue at start and never freed or cached, so N − 1 hold KV
  (``block_pool.py::BlockPool.__init__``: ``self.null_block = self.free_block_queue.popleft()``;
  ``kv_cache_utils.py::may_override_num_blocks``).
- Free blocks form one queue in eviction order, by block id at start; allocation pops from
  its head (``kv_cache_utils.py::FreeKVCacheBlockQueue.popleft_n``;
  ``block_pool.py::BlockPool.get_new_blocks``).
- A popped block that still has a hash is evicted then: the hash leaves the map, a
  ``BlockRemoved`` event (``block_pool.py::_maybe_evict_cached_block``,
  ``_remove_cached_block_hashes``).
- A hit on a block with ``ref_cnt == 0`` takes it out of the queue; every hit adds a reference
  (``block_pool.py::BlockPool.touch``;
  ``single_type_kv_cache_manager.py::add_local_computed_blocks``).
- A request's blocks are freed in reverse order (tail first); a block left with no reference
  goes to the queue's **tail** if it has a hash (LRU) and to its **head** if not (a partial
  block, reused first) (``single_type_kv_cache_manager.py::SingleTypeKVCacheManager.free``;
  ``block_pool.py::BlockPool.free_blocks``: ``prepend_n`` / ``append_n``).
- A block is cached when it is full: at allocation, every full block up to
  ``min(computed + new, num_tokens)`` tokens, prompt and generated tokens alike; a partial
  block never, since ``block_size == hash_block_size`` registers no partial entries
  (``kv_cache_manager.py::allocate_slots``: ``num_tokens_to_cache``;
  ``single_type_kv_cache_manager.py::cache_blocks``, ``FullAttentionManager.cache_blocks``;
  ``block_pool.py::cache_full_blocks``).
- One hash may be cached in several blocks (two requests computed it); a look-up takes the
  oldest; each copy is evicted on its own (``block_pool.py::BlockHashToBlockMap``:
  ``get_one_block``, ``insert``, ``pop``).
- The look-up: the longest run of cached full blocks from the start, at most
  ``num_tokens − 1`` tokens, since the last token is always computed
  (``kv_cache_manager.py::get_computed_blocks``;
  ``single_type_kv_cache_manager.py::FullAttentionManager.find_longest_cache_hit``).

State is flat arrays over every replica's blocks (block ``g = r·NB + b``): references, hash,
the free queue as a doubly linked list with a head and a tail sentinel per replica (vLLM's own
layout), and one (replica, hash) -> oldest block map with a chain of younger copies. Events go
to a preallocated ``int64[cap, 6]`` buffer (ts, location, kind, hash, request, position); a
full buffer sets ``cnt[2]`` and the caller runs again with a larger one.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.typed import Dict

__all__ = ["KIND_REMOVED", "KIND_STORED", "NO_BLOCK"]

KIND_STORED, KIND_REMOVED = 0, 1
NO_BLOCK = -1


_SALT = np.int64(-7046029254386353131)  # 0x9E3779B97F4A7C15 as int64


@njit(cache=True)
def new_maps(n):
    """One map for every replica: (replica, hash) -> oldest block, keyed by ``_key``."""
    return Dict.empty(key_type=types.int64, value_type=types.int64)


@njit(cache=True)
def _key(r, h):
    # hash XOR a per-replica constant: distinct (r, h) collide only if h1 ^ h2 equals the XOR of
    # two replicas' constants, which small trace ids never reach and random 64-bit hashes hit
    # with probability ~n²/2⁶⁴.
    return h ^ (_SALT * (r + 1))


@njit(cache=True)
def fq_init(nxt, prv, nfree, n_rep, nb):
    """Each replica's queue holds blocks 1..nb-1 in id order (block 0 is the null block)."""
    for r in range(n_rep):
        head, tail, base = n_rep * nb + 2 * r, n_rep * nb + 2 * r + 1, r * nb
        last = head
        for b in range(1, nb):
            nxt[last] = base + b
            prv[base + b] = last
            last = base + b
        nxt[last] = tail
        prv[tail] = last
        nfree[r] = nb - 1


@njit(cache=True)
def fq_remove(nxt, prv, nfree, r, g):
    p, n = prv[g], nxt[g]
    nxt[p] = n
    prv[n] = p
    nxt[g] = NO_BLOCK
    prv[g] = NO_BLOCK
    nfree[r] -= 1


@njit(cache=True)
def fq_append(nxt, prv, nfree, r, g, tail):
    last = prv[tail]
    nxt[last] = g
    prv[g] = last
    nxt[g] = tail
    prv[tail] = g
    nfree[r] += 1


@njit(cache=True)
def fq_push_front(nxt, prv, nfree, r, g, head):
    first = nxt[head]
    nxt[head] = g
    prv[g] = head
    nxt[g] = first
    prv[first] = g
    nfree[r] += 1


@njit(cache=True)
def emit(ev, cnt, ts, loc, kind, h, req, pos):
    n = cnt[0]
    if n >= ev.shape[0]:
        cnt[2] = 1  # overflow: the caller reruns with a larger buffer
        return
    ev[n, 0], ev[n, 1], ev[n, 2], ev[n, 3], ev[n, 4], ev[n, 5] = ts, loc, kind, h, req, pos
    cnt[0] = n + 1


@njit(cache=True)
def map_get(maps, r, h):
    k = _key(r, h)
    if k in maps:
        return maps[k]
    return NO_BLOCK


@njit(cache=True)
def map_insert(maps, dnx, dpv, r, h, g):
    """Cache block ``g`` under ``h``; a copy already cached stays first (the oldest wins)."""
    k = _key(r, h)
    if k not in maps:
        maps[k] = g
        dnx[g] = NO_BLOCK
        dpv[g] = NO_BLOCK
        return
    last = maps[k]
    while dnx[last] != NO_BLOCK:
        last = dnx[last]
    dnx[last] = g
    dpv[g] = last
    dnx[g] = NO_BLOCK


@njit(cache=True)
def map_remove(maps, dnx, dpv, r, h, g):
    k = _key(r, h)
    p, n = dpv[g], dnx[g]
    if p == NO_BLOCK:
        if n == NO_BLOCK:
            del maps[k]
        else:
            maps[k] = n
            dpv[n] = NO_BLOCK
    else:
        dnx[p] = n
        if n != NO_BLOCK:
            dpv[n] = p
    dnx[g] = NO_BLOCK
    dpv[g] = NO_BLOCK


@njit(cache=True)
def lookup(maps, r, blk_h, start, n_max, out):
    """Longest run of cached blocks of ``blk_h[start:start+n_max]``; their blocks go to ``out``."""
    n = 0
    while n < n_max:
        g = map_get(maps, r, blk_h[start + n])
        if g == NO_BLOCK:
            break
        out[n] = g
        n += 1
    return n


@njit(cache=True)
def matched(maps, r, blk_h, start, n_max):
    """How many leading blocks of ``blk_h[start:start+n_max]`` replica ``r`` has cached."""
    n = 0
    while n < n_max and _key(r, blk_h[start + n]) in maps:
        n += 1
    return n


@njit(cache=True)
def touch(ref, nxt, prv, nfree, r, blocks, n):
    for k in range(n):
        g = blocks[k]
        if ref[g] == 0:
            fq_remove(nxt, prv, nfree, r, g)
        ref[g] += 1


@njit(cache=True)
def pop_block(ref, bh, hashed, nxt, prv, nfree, maps, dnx, dpv, r, head, ev, cnt, ts):
    """get_new_blocks for one block: the queue's head, its hash evicted (an event)."""
    g = nxt[head]
    fq_remove(nxt, prv, nfree, r, g)
    if hashed[g]:
        map_remove(maps, dnx, dpv, r, bh[g], g)
        hashed[g] = False
        emit(ev, cnt, ts, r, KIND_REMOVED, bh[g], -1, -1)
    ref[g] = 1
    return g


@njit(cache=True)
def cache_block(bh, hashed, maps, dnx, dpv, r, g, h, ev, cnt, ts, req, pos):
    bh[g] = h
    hashed[g] = True
    map_insert(maps, dnx, dpv, r, h, g)
    emit(ev, cnt, ts, r, KIND_STORED, h, req, pos)


@njit(cache=True)
def free_blocks(ref, hashed, nxt, prv, nfree, r, head, tail, table, start, n):
    """Free a request's ``n`` blocks tail first: hashed ones to the queue's tail, others to its head.

    vLLM meets the blocks tail first, appends the hashed ones in that order and ``prepend_n``s
    the unhashed ones in that order (the first met ends up at the very front); pushing each
    unhashed one to the front in the opposite order (head first) builds the same queue.
    """
    for k in range(n - 1, -1, -1):
        g = table[start + k]
        ref[g] -= 1
        if ref[g] == 0 and hashed[g]:
            fq_append(nxt, prv, nfree, r, g, tail)
    for k in range(n):
        g = table[start + k]
        if ref[g] == 0 and not hashed[g]:
            fq_push_front(nxt, prv, nfree, r, g, head)


@njit(cache=True)
def new_pool(capacity):
    """The shared pool (LRU of ``capacity`` blocks): hashes, links (head = LRU), a hash -> slot map."""
    ph = np.zeros(capacity, np.int64)
    pnx = np.full(capacity + 2, NO_BLOCK, np.int64)
    ppv = np.full(capacity + 2, NO_BLOCK, np.int64)
    head, tail = capacity, capacity + 1
    pnx[head] = tail
    ppv[tail] = head
    pmap = Dict.empty(key_type=types.int64, value_type=types.int64)
    return ph, pnx, ppv, pmap


@njit(cache=True)
def pool_touch(pnx, ppv, s, tail):
    p, n = ppv[s], pnx[s]
    pnx[p] = n
    ppv[n] = p
    last = ppv[tail]
    pnx[last] = s
    ppv[s] = last
    pnx[s] = tail
    ppv[tail] = s


@njit(cache=True)
def pool_put(ph, pnx, ppv, pmap, pcnt, h, ev, cnt, ts, req, pos):
    """Store ``h`` at the MRU end; a full pool evicts its LRU block first (an event, location -1)."""
    cap = ph.shape[0]
    head, tail = cap, cap + 1
    if pcnt[0] < cap:
        s = pcnt[0]
        pcnt[0] += 1
    else:
        s = pnx[head]
        del pmap[ph[s]]
        emit(ev, cnt, ts, -1, KIND_REMOVED, ph[s], -1, -1)
        nx = pnx[s]
        pnx[head] = nx
        ppv[nx] = head
    ph[s] = h
    pmap[h] = s
    last = ppv[tail]
    pnx[last] = s
    ppv[s] = last
    pnx[s] = tail
    ppv[tail] = s
    emit(ev, cnt, ts, -1, KIND_STORED, h, req, pos)
