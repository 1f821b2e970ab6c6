"""Analyzers: the cost model: prefill, decode and load times for a model on a device, each labelled.

Two layers. The free functions (``prefill_ms``, ``load_ms``, ``decode_ms``) are the **modelled**
figures the simulator uses: FLOPs at a stated efficiency of a stated device. The prefill of
``new`` tokens after ``cached`` ones costs

    2·P·new  +  2·L·H_q·D·((cached + new)² − cached²)

FLOPs: the weights once per new token, and causal attention of the new tokens over
everything before them (with ``cached = 0`` this is the usual 2·P·T + 2·L·T²·H_q·D).

``cost_model`` builds a :class:`CostModel` that prefers measurements: ``T_recompute(T)`` from
``a + b·T + c·T²`` fitted to the newest GPU probe run's ``prefill`` rows for the model, and the
transfer bandwidths from that device's byte-exact ``h2d_pinned``/``d2h``/``kv_load_batched``
rows; whatever the probe did not measure comes from the :class:`DeviceModel`'s configured
fields. Every figure it returns is a ``(ms, label)`` pair, the label ``measured`` or ``modelled``.
analyzers/crossover.py tabulates it against each load path over a log grid of prefix lengths.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import duckdb
import numpy as np
import polars as pl

from kvlens.models import ModelGeometry

__all__ = [
    "DEFAULT_DEVICE", "CostModel", "DeviceModel", "Label", "LoadPath", "PathCost", "Rate",
    "cost_model", "decode_ms", "load_ms", "prefill_ms", "useful_remote_tokens",
]

log = logging.getLogger(__name__)


class Label(enum.StrEnum):
    """Where a figure came from."""

    MEASURED = "measured"  # fitted to, or taken from, GPU probe rows of this device and model
    MODELLED = "modelled"  # FLOPs at a stated efficiency, or a configured bandwidth / latency


class LoadPath(enum.StrEnum):
    """Where a prefix's KV can be loaded from instead of recomputed."""

    LOCAL_TIER = "local_tier"  # the serving replica's own lower tier (pinned host memory)
    PEER = "peer"  # another replica's GPU, over the network
    POOL = "pool"  # the shared pool (LMCache / Mooncake store), over the network


@dataclass(frozen=True)
class DeviceModel:
    """A serving replica as the simulator sees it; every field is a stated assumption."""

    name: str = "8x H100-SXM, TP8 (modelled)"
    peak_tflops_per_gpu: float = 989.0  # bf16 dense, NVIDIA's H100 SXM datasheet
    gpus_per_replica: int = 8
    efficiency: float = 0.4  # achieved share of peak in prefill
    decode_ms_per_token: float = 20.0  # per sequence, while batched with others (the LRU engine)
    pool_gbps: float = 25.0  # shared pool to GPU, effective GB/s (e.g. one 200 Gb/s RDMA NIC)
    pool_lookup_ms: float = 0.5
    pool_queue_ms: float = 0.0  # waiting behind other loads; 0 assumes an idle pool
    peer_gbps: float = 25.0  # replica to replica, the same NIC
    peer_lookup_ms: float = 0.5
    local_lookup_ms: float = 0.05  # a hash-table probe in the replica's own offload tier
    h2d_gbps: float = 25.0  # pinned host -> GPU, PCIe Gen5 x16 as achieved by one copy
    d2h_gbps: float = 25.0  # GPU -> pinned host
    install_gbps: float = 500.0  # scatter of staged blocks into the paged KV pool, on the GPU
    pool_capacity_bytes: int = 2 * 10**12  # shared pool (e.g. 8 nodes x 256 GB of DRAM)
    # The engine's step time (analyzers/step_time.py): decode reads the weights and the KV once a step.
    hbm_gbps_per_gpu: float = 3350.0  # HBM3, NVIDIA's H100 SXM datasheet
    hbm_efficiency: float = 0.7  # achieved share of it by a decode step
    weight_bytes_per_param: float = 2.0  # bf16 weights
    step_overhead_ms: float = 2.0  # scheduling, sampling and TP all-reduce latency per step

    @property
    def flops_per_ms(self) -> float:
        return self.peak_tflops_per_gpu * 1e12 * self.gpus_per_replica * self.efficiency / 1e3

    @property
    def hbm_bytes_per_ms(self) -> float:
        return self.hbm_gbps_per_gpu * 1e9 * self.gpus_per_replica * self.hbm_efficiency / 1e3


DEFAULT_DEVICE = DeviceModel()


def _attention_dims(model: ModelGeometry) -> tuple[int, int]:
    layers = sum(g.num_layers for g in model.groups)
    return layers, model.hidden_size  # H_q·D = hidden size for the registry's models


def prefill_ms(model: ModelGeometry, new_tokens: int, cached_tokens: int = 0,
               device: DeviceModel = DEFAULT_DEVICE) -> float:
    """Modelled time to prefill ``new_tokens`` after ``cached_tokens`` already in cache."""
    if new_tokens <= 0:
        return 0.0
    layers, width = _attention_dims(model)
    total = cached_tokens + new_tokens
    flops = 2.0 * model.num_params * new_tokens + 2.0 * layers * width * (total**2 - cached_tokens**2)
    return flops / device.flops_per_ms


def decode_ms(output_tokens: int, device: DeviceModel = DEFAULT_DEVICE) -> float:
    return max(output_tokens, 0) * device.decode_ms_per_token


def load_ms(nbytes: int, device: DeviceModel = DEFAULT_DEVICE) -> float:
    """Modelled time to bring ``nbytes`` of KV from the shared pool: lookup + bytes / bandwidth."""
    if nbytes <= 0:
        return 0.0
    return device.pool_lookup_ms + nbytes / (device.pool_gbps * 1e9) * 1e3


def useful_remote_tokens(matched_tokens: int, block_tokens: int) -> int:
    """Tokens a remote match can serve: whole blocks only, floor(T_match / B)·B."""
    return (matched_tokens // block_tokens) * block_tokens


@dataclass(frozen=True)
class Rate:
    """A byte rate: ``ms = fixed_ms + bytes / (gbps·1e6)``, with where it came from."""

    gbps: float
    label: Label
    fixed_ms: float = 0.0

    def ms(self, nbytes: float) -> float:
        return self.fixed_ms + nbytes / (self.gbps * 1e6) if nbytes > 0 else 0.0


@dataclass(frozen=True)
class PathCost:
    """``T_remote`` of one load, term by term (ms), and its label.

    The label is ``measured`` only when every byte-proportional term (transfer, stage,
    install) came from the probe; a sum with any configured term is a model.
    """

    lookup_ms: float
    queue_ms: float
    transfer_ms: float
    stage_ms: float
    install_ms: float
    label: Label

    @property
    def total_ms(self) -> float:
        return self.lookup_ms + self.queue_ms + self.transfer_ms + self.stage_ms + self.install_ms


@dataclass(frozen=True)
class CostModel:
    """Recompute and load times of one model on one device; every method returns (ms, label).

    ``fit`` holds (a, b, c) of ``a + b·T + c·T²`` in ms when calibrated (label ``measured``),
    else None and the FLOP model of ``device`` applies (label ``modelled``). ``fit_tokens`` is
    the measured range; beyond it the fit extrapolates (see ``extrapolated``).
    """

    model: ModelGeometry
    device: DeviceModel
    device_name: str
    fit: tuple[float, float, float] | None = None
    fit_tokens: tuple[int, int] | None = None
    fit_run_id: str | None = None
    h2d: Rate = field(default_factory=lambda: Rate(DEFAULT_DEVICE.h2d_gbps, Label.MODELLED))
    d2h: Rate = field(default_factory=lambda: Rate(DEFAULT_DEVICE.d2h_gbps, Label.MODELLED))
    install: Rate = field(default_factory=lambda: Rate(DEFAULT_DEVICE.install_gbps, Label.MODELLED))

    def recompute_ms(self, tokens: int, cached_tokens: int = 0) -> tuple[float, Label]:
        """T_recompute: prefill ``tokens`` new tokens after ``cached_tokens`` cached ones."""
        if tokens <= 0:
            return 0.0, Label.MEASURED if self.fit else Label.MODELLED
        if self.fit is None:
            return prefill_ms(self.model, tokens, cached_tokens, self.device), Label.MODELLED
        a, b, c = self.fit
        total = cached_tokens + tokens
        return max(a + b * tokens + c * (total**2 - cached_tokens**2), 0.0), Label.MEASURED

    def saved_recompute_ms(self, tokens: int, cached_tokens: int = 0) -> tuple[float, Label]:
        """The prefill a load of ``tokens`` saves: T_recompute without the fixed ``a`` of a call.

        The request still prefills its suffix in a call of its own, so the fixed cost stays.
        """
        ms, label = self.recompute_ms(tokens, cached_tokens)
        return max(ms - (self.fit[0] if self.fit and tokens > 0 else 0.0), 0.0), label

    def remote(self, nbytes: int, path: LoadPath) -> PathCost:
        """T_remote = T_lookup + T_queue + S/B_eff + T_stage + T_install for ``nbytes`` via ``path``."""
        d = self.device
        install = self.install.ms(nbytes)
        if path is LoadPath.LOCAL_TIER:  # the H2D copy is the transfer; nothing to stage
            labels = (self.h2d.label, self.install.label)
            return PathCost(d.local_lookup_ms, 0.0, self.h2d.ms(nbytes), 0.0, install, _all_measured(labels))
        gbps, lookup, queue = ((d.peer_gbps, d.peer_lookup_ms, 0.0) if path is LoadPath.PEER
                               else (d.pool_gbps, d.pool_lookup_ms, d.pool_queue_ms))
        # The network lands the bytes in pinned host memory; an H2D copy stages them to the GPU.
        transfer = Rate(gbps, Label.MODELLED).ms(nbytes)
        return PathCost(lookup, queue, transfer, self.h2d.ms(nbytes), install, Label.MODELLED)

    def remote_ms(self, nbytes: int, path: LoadPath) -> tuple[float, Label]:
        cost = self.remote(nbytes, path)
        return cost.total_ms, cost.label

    def write_ms(self, nbytes: int, path: LoadPath) -> tuple[float, Label]:
        """Time to publish ``nbytes`` to ``path``: GPU -> host, then over the network (not local)."""
        if nbytes <= 0:
            return 0.0, self.d2h.label
        ms = self.d2h.ms(nbytes)
        if path is LoadPath.LOCAL_TIER:
            return self.device.local_lookup_ms + ms, self.d2h.label
        gbps = self.device.peer_gbps if path is LoadPath.PEER else self.device.pool_gbps
        return self.device.pool_lookup_ms + ms + Rate(gbps, Label.MODELLED).ms(nbytes), Label.MODELLED

    def extrapolated(self, tokens: int) -> bool:
        """Whether ``tokens`` lies outside the measured prefill range (the fit extrapolates)."""
        return self.fit_tokens is not None and not self.fit_tokens[0] <= tokens <= self.fit_tokens[1]


def _all_measured(labels: Sequence[Label]) -> Label:
    return Label.MEASURED if all(x is Label.MEASURED for x in labels) else Label.MODELLED


def _gpu_rows(probe_runs: duckdb.DuckDBPyRelation | pl.DataFrame | None, model: ModelGeometry,
              probe_device: str | None) -> pl.DataFrame:
    """The GPU-source probe rows of ``model`` (on ``probe_device`` when given), newest run first."""
    if probe_runs is None:
        return pl.DataFrame()
    rows = probe_runs if isinstance(probe_runs, pl.DataFrame) else probe_runs.pl()
    if rows.is_empty():
        return rows
    rows = rows.filter((pl.col("source") == "gpu") & (pl.col("model") == model.name)
                       & pl.col("ms").is_not_null())
    if probe_device is not None:
        rows = rows.filter(pl.col("device") == probe_device)
    elif not rows.is_empty():  # the device of the newest run of this model
        newest = rows.sort("ts_ns", descending=True).row(0, named=True)["device"]
        rows = rows.filter(pl.col("device") == newest)
    return rows.sort("ts_ns", descending=True)


def _newest_run(rows: pl.DataFrame, path: str, *, byte_exact: bool) -> pl.DataFrame:
    """Rows of ``path`` from the newest run that measured it; transfers must be byte-exact."""
    sel = rows.filter((pl.col("path") == path) & pl.col("prefix_tokens").is_not_null())
    if byte_exact:  # a copy that is not byte-exact measured nothing we can rely on
        sel = sel.filter(pl.col("byte_exact").fill_null(False) & (pl.col("kv_bytes") > 0))
    if sel.is_empty():
        return sel
    run_id = sel.row(0, named=True)["run_id"]  # rows are sorted newest first
    return sel.filter(pl.col("run_id") == run_id)


def _fit_prefill(rows: pl.DataFrame) -> tuple[float, float, float] | None:
    """Least squares of ms = a + b·T + c·T² over the rows; needs three distinct lengths."""
    per = rows.group_by("prefix_tokens").agg(pl.col("ms").median()).sort("prefix_tokens")
    if per.height < 3:
        return None
    t = per["prefix_tokens"].to_numpy().astype(float)
    scale = t.max()  # fit in scaled units: T² of 131,072 would swamp the constant column
    x = t / scale
    design = np.column_stack([np.ones_like(x), x, x * x])
    (a, b, c), *_ = np.linalg.lstsq(design, per["ms"].to_numpy().astype(float), rcond=None)
    return float(a), float(b / scale), float(c / scale**2)


def _fit_rate(rows: pl.DataFrame, configured_gbps: float) -> Rate:
    """A measured byte rate from probe rows (ms = fixed + bytes/B), else the configured one."""
    if rows.is_empty():
        return Rate(configured_gbps, Label.MODELLED)
    nbytes = rows["kv_bytes"].to_numpy().astype(float)
    ms = rows["ms"].to_numpy().astype(float)
    if len(np.unique(nbytes)) >= 2:
        slope, fixed = np.polyfit(nbytes, ms, 1)
        if slope > 0:
            return Rate(1.0 / (slope * 1e6), Label.MEASURED, max(float(fixed), 0.0))
    return Rate(float(nbytes.sum() / ms.sum() / 1e6), Label.MEASURED)


def _install_rate(load: pl.DataFrame, h2d: pl.DataFrame, configured_gbps: float) -> Rate:
    """The scatter into the paged pool: kv_load_batched minus the bulk H2D of the same bytes."""
    if load.is_empty() or h2d.is_empty():
        return Rate(configured_gbps, Label.MODELLED)
    both = load.join(h2d.select("prefix_tokens", pl.col("ms").alias("h2d_ms")), on="prefix_tokens")
    both = both.with_columns((pl.col("ms") - pl.col("h2d_ms")).alias("ms")).filter(pl.col("ms") > 0)
    if both.is_empty():  # the paged load was no slower than one bulk copy: installing is free
        return Rate(float("inf"), Label.MEASURED)
    return _fit_rate(both, configured_gbps)


def cost_model(*, probe_runs: duckdb.DuckDBPyRelation | pl.DataFrame | None, model: ModelGeometry,
               device: DeviceModel = DEFAULT_DEVICE, probe_device: str | None = None) -> CostModel:
    """The cost model of ``model``: calibrated from ``probe_runs`` where it can be, else modelled.

    Only ``source = 'gpu'`` rows of the same model name calibrate. CPU-source rows time a
    narrowed layer stack (``NAME (1/8 width)``) and host memcpys standing in for PCIe copies:
    they prove the code path runs, but their milliseconds say nothing about a GPU, so fitting
    a GPU device's prefill or bandwidth to them would be wrong by orders of magnitude. With
    ``probe_device`` None, the device is that of the newest GPU run of the model; the
    network terms (peer, pool) are always the configured ``device`` fields.
    """
    rows = _gpu_rows(probe_runs, model, probe_device)
    if rows.is_empty():
        return CostModel(model, device, device.name, h2d=Rate(device.h2d_gbps, Label.MODELLED),
                         d2h=Rate(device.d2h_gbps, Label.MODELLED),
                         install=Rate(device.install_gbps, Label.MODELLED))
    prefill = _newest_run(rows, "prefill", byte_exact=False)
    fit = _fit_prefill(prefill) if not prefill.is_empty() else None
    if fit is None:
        log.info("%s: no GPU prefill calibration with three lengths; prefill is modelled", model.name)
    h2d_rows = _newest_run(rows, "h2d_pinned", byte_exact=True)
    tokens = [int(t) for t in prefill["prefix_tokens"].to_list()] if fit else []
    h2d = _fit_rate(h2d_rows, device.h2d_gbps)
    d2h = _fit_rate(_newest_run(rows, "d2h", byte_exact=True), device.d2h_gbps)
    load_rows = _newest_run(rows, "kv_load_batched", byte_exact=True)
    install = _install_rate(load_rows, h2d_rows, device.install_gbps)
    measured = fit is not None or Label.MEASURED in (h2d.label, d2h.label, install.label)
    return CostModel(
        model, device, str(rows.row(0, named=True)["device"]) if measured else device.name, fit=fit,
        fit_tokens=(min(tokens), max(tokens)) if tokens else None,
        fit_run_id=str(prefill.row(0, named=True)["run_id"]) if fit else None,
        h2d=h2d, d2h=d2h, install=install)

