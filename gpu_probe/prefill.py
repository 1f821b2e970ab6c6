"""GPU probe, the compute side: a synthetic stack of the model's real layers, and the matmul rate.

Each layer is what a dense or GQA decoder layer computes in prefill: RMSNorm, one fused QKV
projection, causal attention through PyTorch's scaled-dot-product attention (cuDNN or flash
backend on CUDA; K/V heads shared across query groups), the output projection, RMSNorm, and a
SwiGLU MLP (fused gate/up, then down), with residuals. Weights are random (scaled normal, never
zeros). Left out, as small next to the matmuls: RoPE, the embedding lookup and the LM head (prefill
computes logits for the last token only). Sliding windows are not applied (every layer attends
over the whole prefix, an upper bound); MLA models are refused.

The intermediate (MLP) size is not part of the KV geometry, so it lives here (INTERMEDIATE_SIZES,
from each model's config.json); other models use the LLaMA convention, 8/3·hidden rounded up to a
multiple of 256. ``ms`` of a prefill row is the whole stack's: the stack runs ``layers_run`` of the
model's identical layers (as many as fit in memory) and the time is scaled by
``num_layers / layers_run``. A ``width_divisor`` above 1 (the CPU fallback) narrows every width
and renames the row's model, ``NAME (1/8 width)``, so it is never taken for the real model.

FLOPs per layer (multiply-add = 2): projections ``2·T·hidden·(H·D + 2·H_kv·D) + 2·T·H·D·hidden``,
MLP ``6·T·hidden·I``, causal attention ``2·H·D·T·(T+1)`` (QKᵀ and PV over the T(T+1)/2 visible pairs).
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvlens.errors import ConfigError
from kvlens.gpu_probe.records import Measurement, ProbePath
from kvlens.gpu_probe.timing import import_torch, median_ms, time_ms
from kvlens.models import ModelGeometry

__all__ = [
    "INTERMEDIATE_SIZES",
    "LayerShape",
    "PrefillSetup",
    "layer_shape",
    "layers_that_fit",
    "matmul_flops",
    "measure_matmul",
    "measure_prefill",
    "pick_attention",
    "prefill_flops",
]

log = logging.getLogger(__name__)

# intermediate_size from each registry model's Hugging Face config.json.
INTERMEDIATE_SIZES: dict[str, int] = {
    "llama-3.1-8b": 14336,
    "llama-3.1-70b": 28672,
    "qwen2.5-7b": 18944,
    "qwen2.5-32b": 27648,
    "qwen2.5-72b": 29568,
    "mistral-7b-v0.1": 14336,
    "codellama-13b": 13824,
    "gemma-2-27b": 36864,
}
_RMS_EPS = 1e-5


@dataclass(frozen=True)
class LayerShape:
    """The widths of one decoder layer, and how many layers the model has."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    num_layers: int

    @property
    def weight_elements(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate


def _intermediate(model: ModelGeometry) -> int:
    size = INTERMEDIATE_SIZES.get(model.name)
    if size is None:
        size = 256 * math.ceil(8 * model.hidden_size / 3 / 256)
        log.info("no intermediate size known for %s: using 8/3·hidden -> %d", model.name, size)
    return size


def layer_shape(model: ModelGeometry, *, width_divisor: int = 1,
                intermediate_size: int | None = None) -> LayerShape:
    """The model's layer widths, every width divided by ``width_divisor`` (head size kept)."""
    if any(g.kind == "mla" for g in model.groups):
        raise ConfigError(f"{model.name} uses multi-head latent attention, which the prefill stack "
                          "does not model; probe a dense or GQA model")
    group = model.groups[0]
    intermediate = intermediate_size or _intermediate(model)
    heads, kv_heads = model.num_attention_heads, group.num_kv_heads
    if width_divisor == 1:
        return LayerShape(model.name, model.hidden_size, heads, kv_heads, group.head_dim,
                          intermediate, model.num_layers)
    # Narrowed, the query-group ratio (GQA) is kept: heads stay a multiple of KV heads.
    kv_small = max(1, kv_heads // width_divisor)
    heads_small = max(kv_small, heads // width_divisor // kv_small * kv_small)
    return LayerShape(f"{model.name} (1/{width_divisor} width)",
                      max(1, model.hidden_size // width_divisor), heads_small, kv_small,
                      group.head_dim, max(1, intermediate // width_divisor), model.num_layers)


def prefill_flops(shape: LayerShape, tokens: int, layers: int | None = None) -> float:
    """FLOPs of a causal prefill of ``tokens`` through ``layers`` (default all) layers."""
    t, q = tokens, shape.heads * shape.head_dim
    projections = 2 * t * shape.hidden * (q + 2 * shape.kv_heads * shape.head_dim) + 2 * t * q * shape.hidden
    mlp = 6 * t * shape.hidden * shape.intermediate
    attention = 2 * shape.heads * shape.head_dim * t * (t + 1)
    return float((shape.num_layers if layers is None else layers) * (projections + mlp + attention))


def matmul_flops(n: int) -> float:
    return 2.0 * n**3


def layers_that_fit(shape: LayerShape, *, free_bytes: int, share: float = 0.4) -> int:
    """How many bf16 layers fit in ``share`` of ``free_bytes`` (at least 1, at most all)."""
    per_layer = 2 * shape.weight_elements
    return max(1, min(shape.num_layers, int(free_bytes * share) // per_layer))


def _weights(shape: LayerShape, layers: int, device: str, dtype: Any) -> list[dict[str, Any]]:
    torch = import_torch()
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim

    def linear(fan_in: int, fan_out: int) -> Any:
        return torch.randn(fan_in, fan_out, device=device, dtype=dtype) / math.sqrt(fan_in)

    def norm() -> Any:
        return 1 + 0.1 * torch.randn(shape.hidden, device=device, dtype=dtype)

    return [{"norm1": norm(), "qkv": linear(shape.hidden, q + 2 * kv), "o": linear(q, shape.hidden),
             "norm2": norm(), "gate_up": linear(shape.hidden, 2 * shape.intermediate),
             "down": linear(shape.intermediate, shape.hidden)} for _ in range(layers)]


def _rms_norm(x: Any, weight: Any) -> Any:
    torch = import_torch()
    if hasattr(torch.nn.functional, "rms_norm"):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, _RMS_EPS)
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + _RMS_EPS).to(x.dtype) * weight


Attention = Callable[[Any, Any, Any], Any]


def _heads(qkv: Any, shape: LayerShape) -> tuple[Any, Any, Any]:
    """[T, (H + 2·H_kv)·D] -> q [1, H, T, D], k and v [1, H_kv, T, D]: views, as engines pass them."""
    t, d = qkv.shape[0], shape.head_dim
    widths = [shape.heads * d, shape.kv_heads * d, shape.kv_heads * d]
    q, k, v = qkv.split(widths, dim=-1)
    return (q.view(t, shape.heads, d).transpose(0, 1).unsqueeze(0),
            k.view(t, shape.kv_heads, d).transpose(0, 1).unsqueeze(0),
            v.view(t, shape.kv_heads, d).transpose(0, 1).unsqueeze(0))


def _layer(x: Any, w: dict[str, Any], shape: LayerShape, attention: Attention) -> Any:
    torch = import_torch()
    q, k, v = _heads(_rms_norm(x, w["norm1"]) @ w["qkv"], shape)
    attn = attention(q, k, v)[0].transpose(0, 1).reshape(x.shape[0], shape.heads * shape.head_dim)
    x = x + attn @ w["o"]
    gate, up = (_rms_norm(x, w["norm2"]) @ w["gate_up"]).chunk(2, dim=-1)
    return x + (torch.nn.functional.silu(gate) * up) @ w["down"]


def _attention_candidates(shape: LayerShape, device: str) -> list[tuple[str, Attention]]:
    """SDPA variants in order of preference; the first that runs on this device is used."""
    torch = import_torch()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    groups = shape.heads // shape.kv_heads

    def native(q: Any, k: Any, v: Any) -> Any:
        return sdpa(q, k, v, is_causal=True, enable_gqa=groups > 1)

    def expanded(q: Any, k: Any, v: Any) -> Any:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return sdpa(q, k, v, is_causal=True)

    if device != "cuda":
        return [("sdpa gqa", native), ("sdpa expanded kv", expanded)]
    from torch.nn.attention import SDPBackend

    fast = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]
    return [("sdpa cudnn|flash gqa", _restricted(native, fast)),
            ("sdpa flash gqa", _restricted(native, [SDPBackend.FLASH_ATTENTION])),
            ("sdpa cudnn|flash expanded kv", _restricted(expanded, fast)),
            ("sdpa default expanded kv", expanded)]


def _restricted(fn: Attention, backends: list[Any]) -> Attention:
    from torch.nn.attention import sdpa_kernel

    def run(q: Any, k: Any, v: Any) -> Any:
        try:
            ctx = sdpa_kernel(backends, set_priority=True)
        except TypeError:  # torch before 2.6 has no set_priority
            ctx = sdpa_kernel(backends)
        with ctx:
            return fn(q, k, v)

    return run


def pick_attention(shape: LayerShape, device: str, dtype: Any) -> tuple[str, Attention]:
    """The first SDPA variant that runs (and gives finite output) on a small causal input.

    The trial input has the real call's layout: head views of one fused QKV projection.
    """
    torch = import_torch()
    width = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    q, k, v = _heads(torch.randn(256, width, device=device, dtype=dtype), shape)
    errors = []
    for name, fn in _attention_candidates(shape, device):
        try:
            with warnings.catch_warnings():  # SDPA warns about every backend it rejects
                warnings.simplefilter("ignore")
                if bool(torch.isfinite(fn(q, k, v)).all()):
                    return name, fn
        except (RuntimeError, TypeError) as err:
            errors.append(f"{name}: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
    raise ConfigError(f"no scaled-dot-product attention runs on {device}: " + "; ".join(errors))


@dataclass(frozen=True)
class PrefillSetup:
    """How the prefill rows were measured: the layer widths, layers run, the SDPA variant."""

    shape: LayerShape
    layers_run: int
    attention: str


def measure_prefill(model: ModelGeometry, prefix_tokens: list[int], *, device: str,
                    layers: int | None = None, width_divisor: int = 1, warmup: int = 1,
                    runs: int = 5, seed: int = 0) -> tuple[PrefillSetup, list[Measurement]]:
    """One prefill row per prefix length: median whole-stack ms and achieved TFLOP/s (bf16)."""
    torch = import_torch()
    dtype = torch.bfloat16
    shape = layer_shape(model, width_divisor=width_divisor)
    if layers is None:
        layers = (layers_that_fit(shape, free_bytes=torch.cuda.mem_get_info()[0])
                  if device == "cuda" else shape.num_layers)
    layers = max(1, min(layers, shape.num_layers))
    torch.manual_seed(seed)
    weights = _weights(shape, layers, device, dtype)
    name, attention = pick_attention(shape, device, dtype)
    out = []
    with torch.inference_mode():
        for tokens in prefix_tokens:
            x = torch.randn(tokens, shape.hidden, device=device, dtype=dtype)

            def run(x: Any = x) -> None:
                hidden = x
                for w in weights:
                    hidden = _layer(hidden, w, shape, attention)

            out.append(_prefill_row(model, shape, tokens, layers,
                                    time_ms(run, device=device, warmup=warmup, runs=runs)))
    return PrefillSetup(shape, layers, name), out


def _prefill_row(model: ModelGeometry, shape: LayerShape, tokens: int, layers: int,
                 samples: list[float]) -> Measurement:
    scale = shape.num_layers / layers  # identical layers: the stack's time is linear in them
    ms = median_ms(samples) * scale
    tflops = prefill_flops(shape, tokens) / (ms * 1e-3) / 1e12
    return Measurement(ProbePath.PREFILL, shape.name, tokens, model.kv_bytes(tokens), ms,
                       tflops=tflops, runs_ms=tuple(s * scale for s in samples), ts_ns=time.time_ns())


def measure_matmul(n: int, *, device: str, model: str = "", warmup: int = 2, runs: int = 5,
                   inner: int = 1, seed: int = 0) -> Measurement:
    """The bf16 rate of an n×n×n product on this device (``prefix_tokens`` holds n).

    Each timed run is ``inner`` back-to-back products, so a sample is long enough (tens of ms on
    a GPU) for clocks to settle and launch gaps not to count; ``ms`` is per product.
    """
    torch = import_torch()
    torch.manual_seed(seed)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        def run() -> None:
            for _ in range(inner):
                torch.matmul(a, b, out=out)

        samples = [s / inner for s in time_ms(run, device=device, warmup=warmup, runs=runs)]
    ms = median_ms(samples)
    return Measurement(ProbePath.MATMUL_BF16, model, n, None, ms, tflops=matmul_flops(n) / (ms * 1e-3) / 1e12,
                       runs_ms=tuple(samples), ts_ns=time.time_ns())
