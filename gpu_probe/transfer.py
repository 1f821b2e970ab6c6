"""GPU probe, the transfer paths: bulk copies and paged KV loads, timed and byte-gated.

Paths (``probe_runs.path``), all for the bytes of one prefix of the model (``kv_bytes``):

- ``h2d_pinned`` / ``h2d_pageable``: one bulk host -> device copy from pinned / pageable memory;
- ``d2h``: one bulk device -> host copy into pinned memory; ``d2d``: one device -> device copy;
- ``kv_load_batched``: the prefix's blocks staged per layer, then one scatter per layer into the
  paged pool (kvpool.load_batched); ``kv_load_per_block``: one copy per block into the pool.

Each path runs after warm-up, ``runs`` times, destination poisoned (0xA5) before every run;
``ms`` is the median, and ``byte_exact`` gates the last run's destination against the source,
byte for byte. On the CPU fallback "host" and "device" are both host memory (nothing is pinned):
the code path runs, the numbers are a memcpy's.

``delay_injection_check`` proves the gate can fail: the producer of the batched load is delayed
(``torch.cuda._sleep`` on its stream; a sleeping thread on the CPU); the ordered consumer stays
byte-exact and the unordered control must be caught.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvlens.gpu_probe.kvpool import (
    KvBuffers,
    allocate_kv,
    bytes_equal,
    gate_kv,
    load_batched,
    load_per_block,
    poison_,
    poison_kv,
)
from kvlens.gpu_probe.records import Measurement, ProbePath, gbps
from kvlens.gpu_probe.timing import import_torch, median_ms, time_ms
from kvlens.models import ModelGeometry

__all__ = ["DelayCheck", "delay_injection_check", "measure_transfers"]

log = logging.getLogger(__name__)

# ~0.1 s at the H200's 1.98 GHz boost clock: far longer than the scatter it must outlast.
DELAY_CYCLES = 200_000_000
DELAY_S = 0.2


@dataclass(frozen=True)
class DelayCheck:
    """The delay-injection result: the ordered path must stay exact, the control must not."""

    ordered_exact: bool
    control_exact: bool
    delay: str

    @property
    def control_caught(self) -> bool:
        return not self.control_exact

    @property
    def passed(self) -> bool:
        return self.ordered_exact and self.control_caught


def _sync(device: str) -> None:
    if device == "cuda":
        import_torch().cuda.synchronize()


def _timed(path: ProbePath, model: ModelGeometry, prefix_tokens: int, moved_bytes: int,
           run: Callable[[], None], before: Callable[[], None], gate: Callable[[], bool], *,
           device: str, warmup: int, runs: int) -> Measurement:
    samples = time_ms(run, device=device, warmup=warmup, runs=runs, before=before)
    _sync(device)
    ms = median_ms(samples)
    exact = gate()
    if not exact:
        log.error("%s at %d tokens is not byte-exact", path, prefix_tokens)
    return Measurement(path, model.name, prefix_tokens, moved_bytes, ms, gbps(moved_bytes, ms), exact,
                       runs_ms=tuple(samples), ts_ns=time.time_ns())


def _bulk(buf: KvBuffers, model: ModelGeometry, prefix_tokens: int, *, warmup: int,
          runs: int) -> list[Measurement]:
    torch = import_torch()
    device, n = buf.device, buf.nbytes
    src = buf.host.view(torch.uint8)  # pinned on CUDA
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    timing: dict[str, Any] = {"device": device, "warmup": warmup, "runs": runs}
    out = [_timed(ProbePath.H2D_PINNED, model, prefix_tokens, n,
                  lambda: dev.copy_(src, non_blocking=True), lambda: poison_(dev),
                  lambda: bytes_equal(dev, src), **timing),
           _pageable(src, dev, model, prefix_tokens, timing)]
    dev.copy_(src)  # the device copy is the next paths' source, whatever the gates said
    out.append(_d2h(src, dev, model, prefix_tokens, timing))
    dev_dst = buf.staging.view(torch.uint8)  # the staging buffer is poisoned before every KV run
    out.append(_timed(ProbePath.D2D, model, prefix_tokens, n,
                      lambda: dev_dst.copy_(dev), lambda: poison_(dev_dst),
                      lambda: bytes_equal(dev_dst, src), **timing))
    return out


def _pageable(src: Any, dev: Any, model: ModelGeometry, prefix_tokens: int,
              timing: dict[str, Any]) -> Measurement:
    torch = import_torch()
    pageable = torch.empty(src.numel(), dtype=torch.uint8)  # freed when this path is done
    pageable.copy_(src)
    return _timed(ProbePath.H2D_PAGEABLE, model, prefix_tokens, src.numel(),
                  lambda: dev.copy_(pageable), lambda: poison_(dev), lambda: bytes_equal(dev, src),
                  **timing)


def _d2h(src: Any, dev: Any, model: ModelGeometry, prefix_tokens: int,
         timing: dict[str, Any]) -> Measurement:
    torch = import_torch()
    host = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=timing["device"] == "cuda")
    return _timed(ProbePath.D2H, model, prefix_tokens, src.numel(),
                  lambda: host.copy_(dev, non_blocking=True), lambda: poison_(host),
                  lambda: bytes_equal(host, src), **timing)


def _kv(buf: KvBuffers, model: ModelGeometry, prefix_tokens: int, *, warmup: int,
        runs: int) -> list[Measurement]:
    timing: dict[str, Any] = {"device": buf.device, "warmup": warmup, "runs": runs}
    return [
        _timed(ProbePath.KV_LOAD_BATCHED, model, prefix_tokens, buf.nbytes,
               lambda: load_batched(buf), lambda: poison_kv(buf), lambda: gate_kv(buf), **timing),
        _timed(ProbePath.KV_LOAD_PER_BLOCK, model, prefix_tokens, buf.nbytes,
               lambda: load_per_block(buf), lambda: poison_kv(buf), lambda: gate_kv(buf), **timing),
    ]


def measure_transfers(model: ModelGeometry, prefix_tokens: int, *, device: str, warmup: int = 1,
                      runs: int = 5, seed: int = 0) -> list[Measurement]:
    """The six transfer paths for one prefix length, in ProbePath order."""
    buf = allocate_kv(model, prefix_tokens, device=device, seed=seed)
    try:
        return [*_bulk(buf, model, prefix_tokens, warmup=warmup, runs=runs),
                *_kv(buf, model, prefix_tokens, warmup=warmup, runs=runs)]
    finally:
        del buf
        if device == "cuda":
            _release_cached_memory()


def _release_cached_memory() -> None:
    # Freed device and pinned host blocks stay cached by PyTorch; the next, longer prefix needs
    # them back (the pinned cache rounds sizes up to powers of two).
    torch = import_torch()
    torch.cuda.empty_cache()
    accelerator = getattr(torch, "accelerator", None)
    host_empty = (getattr(accelerator, "empty_host_cache", None)
                  or getattr(torch._C, "_host_emptyCache", None))
    if host_empty is not None:
        host_empty()


def delay_injection_check(model: ModelGeometry, *, device: str, prefix_tokens: int | None = None,
                          delay_cycles: int = DELAY_CYCLES, delay_s: float = DELAY_S,
                          seed: int = 1) -> DelayCheck:
    """Run the batched load with a delayed producer, ordered and unordered; gate both."""
    tokens = prefix_tokens if prefix_tokens is not None else 4 * model.block_size_tokens
    buf = allocate_kv(model, tokens, device=device, seed=seed)

    def trial(ordered: bool) -> bool:
        poison_kv(buf)
        _sync(device)
        load_batched(buf, ordered=ordered, delay_cycles=delay_cycles, delay_s=delay_s)
        _sync(device)
        return gate_kv(buf)

    delay = f"{delay_cycles:,} GPU cycles" if device == "cuda" else f"{delay_s:g} s"
    result = DelayCheck(ordered_exact=trial(True), control_exact=trial(False), delay=delay)
    if not result.passed:
        log.error("delay injection: ordered exact=%s, unordered control exact=%s",
                  result.ordered_exact, result.control_exact)
    return result
