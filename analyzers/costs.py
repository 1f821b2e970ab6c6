"""Analyzers: the cost model: modelled prefill, decode and load times for a model on a device.

Every figure here is **modelled**, not measured: FLOPs at a stated efficiency of a stated
device. (Calibration from the GPU probe's measured prefill replaces it where present; see
the probe.) The prefill of ``new`` tokens after ``cached`` ones costs

    2·P·new  +  2·L·H_q·D·((cached + new)² − cached²)

FLOPs: the weights once per new token, and causal attention of the new tokens over
everything before them (with ``cached = 0`` this is the usual 2·P·T + 2·L·T²·H_q·D).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlens.models import ModelGeometry

__all__ = ["DEFAULT_DEVICE", "DeviceModel", "decode_ms", "load_ms", "prefill_ms", "useful_remote_tokens"]


@dataclass(frozen=True)
class DeviceModel:
    """A serving replica as the simulator sees it; every field is a stated assumption."""

    name: str = "8x H100-SXM, TP8 (modelled)"
    peak_tflops_per_gpu: float = 989.0  # bf16 dense, NVIDIA's H100 SXM datasheet
    gpus_per_replica: int = 8
    efficiency: float = 0.4  # achieved share of peak in prefill
    decode_ms_per_token: float = 20.0  # per sequence, while batched with others
    pool_gbps: float = 25.0  # shared pool to GPU, effective GB/s (e.g. one 200 Gb/s RDMA NIC)
    pool_lookup_ms: float = 0.5

    @property
    def flops_per_ms(self) -> float:
        return self.peak_tflops_per_gpu * 1e12 * self.gpus_per_replica * self.efficiency / 1e3


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
