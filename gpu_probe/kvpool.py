"""GPU probe, the paged KV pool: the model's real block layout, the two load paths, the byte gate.

Each layer's pool is ``[tensors, pool_blocks, block_size, kv_heads, head_dim]`` (tensors 2: K and
V; 1 for an MLA latent), as vLLM lays out a paged KV cache. A prefix's blocks arrive in one flat
host buffer (pinned on CUDA), per layer ``[tensors, blocks, block_size, kv_heads, head_dim]``, as
a connector receives them, and are installed at scattered block ids (one table for all layers):

- ``load_batched``: a producer stages each layer on the device (one copy per layer, on a side
  stream), and a consumer scatters each staged layer into the pool with one ``index_copy_``,
  after waiting for that layer's event. ``ordered=False`` skips the wait: the deliberately
  unordered control, which the byte gate must catch once the producer is delayed.
- ``load_per_block``: one copy per block (and per K/V tensor) straight into the pool.

The gate (``gate_kv``, ``bytes_equal``) compares bytes, never floats: NaN payloads, signed zeros
and any bit flip count. Destinations are poisoned with 0xA5 bytes before each run (``poison_``).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvlens.errors import ConfigError
from kvlens.gpu_probe.timing import import_torch
from kvlens.models import ModelGeometry, dtype_bytes

__all__ = [
    "POISON_BYTE",
    "KvBuffers",
    "LayerLayout",
    "allocate_kv",
    "bytes_equal",
    "gate_kv",
    "kv_layout",
    "load_batched",
    "load_per_block",
    "loaded_tokens",
    "poison_",
    "poison_kv",
]

POISON_BYTE = 0xA5
_CHUNK_BYTES = 1 << 28  # the gate compares in 256 MiB pieces, so it needs no second full copy
_FLOAT_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                 "fp32": "float32", "float32": "float32"}


@dataclass(frozen=True)
class LayerLayout:
    """One layer's share of a prefix: ``blocks`` blocks of ``tensors`` KV tensors."""

    tensors: int
    blocks: int
    block_tokens: int
    kv_heads: int
    head_dim: int
    element_bytes: int

    def shape(self, blocks: int | None = None) -> tuple[int, int, int, int, int]:
        n = self.blocks if blocks is None else blocks
        return (self.tensors, n, self.block_tokens, self.kv_heads, self.head_dim)

    @property
    def elements(self) -> int:
        return math.prod(self.shape())

    @property
    def nbytes(self) -> int:
        return self.elements * self.element_bytes


def loaded_tokens(model: ModelGeometry, prefix_tokens: int) -> int:
    """Tokens a load installs: full blocks only, ``floor(T / B)·B`` (the tail is recomputed)."""
    block = model.block_size_tokens
    if not isinstance(prefix_tokens, int) or prefix_tokens < block:
        raise ConfigError(f"prefix of {prefix_tokens!r} tokens holds no full {block}-token block "
                          f"of {model.name}; pass prefix lengths >= {block}")
    return prefix_tokens // block * block


def kv_layout(model: ModelGeometry, prefix_tokens: int) -> tuple[LayerLayout, ...]:
    """Per layer, the blocks of a ``prefix_tokens``-long prefix (sliding layers keep their window)."""
    tokens = loaded_tokens(model, prefix_tokens)
    element_bytes = dtype_bytes(model.kv_dtype)
    layers: list[LayerLayout] = []
    for group in model.groups:
        # A window that is not a multiple of the block size still occupies whole blocks.
        blocks = math.ceil(group.cached_tokens(tokens) / model.block_size_tokens)
        tensors = 1 if group.kind == "mla" else 2
        layers += [LayerLayout(tensors, blocks, model.block_size_tokens, group.num_kv_heads,
                               group.head_dim, element_bytes)] * group.num_layers
    return tuple(layers)


def torch_dtype(kv_dtype: str) -> Any:
    """The torch dtype KV blocks are held in; fp8 caches travel as bytes (uint8)."""
    torch = import_torch()
    name = _FLOAT_DTYPES.get(kv_dtype.strip().lower())
    return getattr(torch, name) if name else torch.uint8


@dataclass
class KvBuffers:
    """A prefix's KV on the host (the source), a device staging copy, and the paged pools."""

    device: str
    layouts: tuple[LayerLayout, ...]
    host: Any
    staging: Any
    pool: Any  # every layer's pool, flat; ``pools`` are its per-layer views
    pools: list[Any]
    ids: list[Any]
    ids_list: list[list[int]]
    offsets: list[int]
    streams: list[Any] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(layout.nbytes for layout in self.layouts)

    def host_layer(self, i: int) -> Any:
        return self._layer(self.host, i)

    def staging_layer(self, i: int) -> Any:
        return self._layer(self.staging, i)

    def _layer(self, flat: Any, i: int) -> Any:
        layout = self.layouts[i]
        return flat[self.offsets[i]:self.offsets[i] + layout.elements].view(layout.shape())


def allocate_kv(model: ModelGeometry, prefix_tokens: int, *, device: str, seed: int = 0,
                spare_ratio: float = 0.25) -> KvBuffers:
    """Buffers for one prefix: random (never zero) source bytes, pools with spare blocks."""
    torch = import_torch()
    layouts = kv_layout(model, prefix_tokens)
    dtype = torch_dtype(model.kv_dtype)
    offsets = [0]
    for layout in layouts:
        offsets.append(offsets[-1] + layout.elements)
    host = torch.empty(offsets[-1], dtype=dtype, pin_memory=device == "cuda")
    staging = torch.empty(offsets[-1], dtype=dtype, device=device)
    torch.manual_seed(seed)
    # Random values, made where it is fast, kept on the host as the connector's received bytes.
    _fill_random_(staging)
    host.copy_(staging)
    pools, ids, ids_list = [], [], []
    tables: dict[tuple[int, int], list[int]] = {}
    shapes = []
    for layout in layouts:
        pool_blocks = layout.blocks + max(1, math.ceil(layout.blocks * spare_ratio))
        # One block table for every layer of a shape, scattered like an engine's free list.
        key = (layout.blocks, pool_blocks)
        if key not in tables:
            tables[key] = torch.randperm(pool_blocks)[:layout.blocks].tolist()
        table = tables[key]
        shapes.append(layout.shape(pool_blocks))
        ids.append(torch.tensor(table, dtype=torch.long, device=device))
        ids_list.append(table)
    # One allocation holds every layer's pool, so poisoning them all is one fill.
    pool = torch.empty(sum(math.prod(shape) for shape in shapes), dtype=dtype, device=device)
    start = 0
    for shape in shapes:
        pools.append(pool[start:start + math.prod(shape)].view(shape))
        start += math.prod(shape)
    return KvBuffers(device, layouts, host, staging, pool, pools, ids, ids_list, offsets[:-1])


def _fill_random_(t: Any) -> None:
    torch = import_torch()
    if t.dtype == torch.uint8:
        t.random_(1, 255)
    else:
        t.normal_()


def poison_(t: Any) -> None:
    """Fill a contiguous tensor's bytes with POISON_BYTE."""
    t.view(import_torch().uint8).fill_(POISON_BYTE)


def poison_kv(buf: KvBuffers, *, staging: bool = True) -> None:
    """Poison every pool (and the staging buffer), so a missed copy cannot pass the gate."""
    if staging:
        poison_(buf.staging)
    poison_(buf.pool)


def _byte_view(t: Any) -> Any:
    return t.contiguous().reshape(-1).view(import_torch().uint8)


def bytes_equal(a: Any, b: Any, *, chunk_bytes: int = _CHUNK_BYTES) -> bool:
    """True when ``a`` and ``b`` hold the same bytes (on any devices), compared as uint8."""
    torch = import_torch()
    left, right = _byte_view(a), _byte_view(b)
    if left.numel() != right.numel():
        return False
    for start in range(0, left.numel(), chunk_bytes):
        piece = left[start:start + chunk_bytes]
        if not torch.equal(piece, right[start:start + chunk_bytes].to(piece.device)):
            return False
    return True


def gate_kv(buf: KvBuffers) -> bool:
    """True when every installed block equals its source block, byte for byte.

    The installed blocks are gathered into the staging buffer (scratch once a load is done),
    so the comparison is one pass over the prefix's bytes without a second device copy.
    """
    torch = import_torch()
    for i, (pool, ids) in enumerate(zip(buf.pools, buf.ids, strict=True)):
        torch.index_select(pool, 1, ids, out=buf.staging_layer(i))
    return bytes_equal(buf.staging, buf.host)


def load_per_block(buf: KvBuffers) -> None:
    """One copy per block and K/V tensor, host -> pool, on the current stream."""
    for i, layout in enumerate(buf.layouts):
        src, pool = buf.host_layer(i), buf.pools[i]
        for j, block_id in enumerate(buf.ids_list[i]):
            for t in range(layout.tensors):
                pool[t, block_id].copy_(src[t, j], non_blocking=True)


def load_batched(buf: KvBuffers, *, ordered: bool = True, delay_cycles: int = 0,
                 delay_s: float = 0.0) -> None:
    """Stage each layer, then scatter it into the pool with one ``index_copy_`` per layer.

    The producer (staging) is delayed by ``delay_cycles`` GPU cycles on CUDA or ``delay_s``
    seconds on the CPU; ``ordered=False`` lets the consumer scatter without waiting for it.
    """
    if buf.device == "cuda":
        _batched_cuda(buf, ordered, delay_cycles)
    else:
        _batched_cpu(buf, ordered, delay_s)


def _batched_cuda(buf: KvBuffers, ordered: bool, delay_cycles: int) -> None:
    torch = import_torch()
    if not buf.streams:
        buf.streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    producer, consumer = buf.streams
    current = torch.cuda.current_stream()
    producer.wait_stream(current)  # the poisoning (and the start event) come first
    consumer.wait_stream(current)
    ready = []
    with torch.cuda.stream(producer):
        if delay_cycles:
            torch.cuda._sleep(delay_cycles)
        for i in range(len(buf.layouts)):
            buf.staging_layer(i).copy_(buf.host_layer(i), non_blocking=True)
            event = torch.cuda.Event()
            event.record(producer)
            ready.append(event)
    with torch.cuda.stream(consumer):
        for i, event in enumerate(ready):
            if ordered:
                consumer.wait_event(event)
            buf.pools[i].index_copy_(1, buf.ids[i], buf.staging_layer(i))
    current.wait_stream(producer)
    current.wait_stream(consumer)


def _batched_cpu(buf: KvBuffers, ordered: bool, delay_s: float) -> None:
    # The CPU stand-in for two streams: a producer thread and the calling thread as consumer,
    # ordered by one threading.Event per layer.
    ready = [threading.Event() for _ in buf.layouts]

    def produce() -> None:
        if delay_s:
            time.sleep(delay_s)
        for i, event in enumerate(ready):
            buf.staging_layer(i).copy_(buf.host_layer(i))
            event.set()

    producer = threading.Thread(target=produce, name="kv-producer", daemon=True)
    producer.start()
    try:
        for i, event in enumerate(ready):
            if ordered:
                event.wait()
            buf.pools[i].index_copy_(1, buf.ids[i], buf.staging_layer(i))
    finally:
        producer.join()
