"""The spine: KV-cache geometry of models, the bytes a cached token costs, from attention layout.

KV-cache size comes from the attention layout (layers, KV heads, head size, window, MLA latent)
and the cache dtype, never from the parameter count: two models of one size can differ tenfold.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from kvlens.errors import ConfigError, InputError

__all__ = [
    "DEFAULT_MODEL",
    "DTYPE_BYTES",
    "GROUP_KINDS",
    "MODELS",
    "KvCacheGroup",
    "KvDtype",
    "KvGroup",
    "ModelGeometry",
    "dtype_bytes",
    "from_hf_config",
    "get_model",
    "group_bytes_per_token",
    "kv_cache_groups",
    "kv_groups_from_hf_config",
    "resolve_model",
]

# A KV-cache dtype name, one of DTYPE_BYTES' keys (matched case-insensitively).
KvDtype = str

DTYPE_BYTES: dict[str, int] = {
    "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8": 1,
    "fp32": 4, "float32": 4,
}

# Kinds of layer group: full attention, sliding-window attention, multi-head latent attention.
GROUP_KINDS = ("full", "sliding", "mla")

# The Mooncake trace's model; 320 KiB per token in bf16.
DEFAULT_MODEL = "llama-3.1-70b"

# HF torch_dtype values that also make a sensible default KV-cache dtype.
_HF_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def dtype_bytes(dtype: KvDtype) -> int:
    """Bytes per cached element for a KV dtype name; ConfigError if the name is unknown."""
    size = DTYPE_BYTES.get(str(dtype).strip().lower())
    if size is None:
        accepted = ", ".join(DTYPE_BYTES)
        raise ConfigError(f"unknown KV-cache dtype {dtype!r}; accepted: {accepted}")
    return size


def _positive_int(value: object) -> TypeGuard[int]:
    # bool is an int subclass; True is not a layer count.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_tp(tp_size: int) -> None:
    if not _positive_int(tp_size):
        raise ConfigError(f"tensor-parallel size must be an integer >= 1, got {tp_size!r}")


@dataclass(frozen=True)
class KvGroup:
    """Layers sharing one KV layout; build with ``full``, ``sliding`` or ``mla``.

    An MLA group caches one latent of ``kv_lora_rank + qk_rope_head_dim`` entries per token,
    read by both K and V; it is stored as one "head" of that size, so ``num_kv_heads`` is 1
    and ``head_dim`` is the latent width.
    """

    kind: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_window_tokens: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            accepted = ", ".join(GROUP_KINDS)
            raise ConfigError(f"unknown layer kind {self.kind!r}; accepted: {accepted}")
        for field in ("num_layers", "num_kv_heads", "head_dim"):
            if not _positive_int(getattr(self, field)):
                raise ConfigError(f"{field} must be an integer >= 1, got {getattr(self, field)!r}")
        self._check_window()
        self._check_latent()

    def _check_window(self) -> None:
        window = self.sliding_window_tokens
        if self.kind == "sliding" and not _positive_int(window):
            raise ConfigError(f"a sliding group needs sliding_window_tokens >= 1, got {window!r}")
        if self.kind != "sliding" and window is not None:
            raise ConfigError(f"sliding_window_tokens is set on a {self.kind!r} group")

    def _check_latent(self) -> None:
        rank, rope = self.kv_lora_rank, self.qk_rope_head_dim
        if self.kind != "mla":
            if rank is not None or rope is not None:
                raise ConfigError(f"kv_lora_rank/qk_rope_head_dim set on a {self.kind!r} group")
            return
        if not (_positive_int(rank) and _positive_int(rope)):
            raise ConfigError(f"an MLA group needs kv_lora_rank and qk_rope_head_dim >= 1, "
                              f"got {rank!r} and {rope!r}")
        if (self.num_kv_heads, self.head_dim) != (1, rank + rope):
            raise ConfigError("an MLA group caches one latent head of kv_lora_rank + "
                              "qk_rope_head_dim entries; build it with KvGroup.mla")

    @classmethod
    def full(cls, num_layers: int, num_kv_heads: int, head_dim: int) -> KvGroup:
        return cls("full", num_layers, num_kv_heads, head_dim)

    @classmethod
    def sliding(cls, num_layers: int, num_kv_heads: int, head_dim: int,
                window_tokens: int) -> KvGroup:
        return cls("sliding", num_layers, num_kv_heads, head_dim,
                   sliding_window_tokens=window_tokens)

    @classmethod
    def mla(cls, num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int) -> KvGroup:
        return cls("mla", num_layers, 1, kv_lora_rank + qk_rope_head_dim,
                   kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim)

    def bytes_per_token(self, element_bytes: int, tp_size: int = 1) -> int:
        """Bytes one token adds to this group's cache on one tensor-parallel rank."""
        # Heads split across ranks; with more ranks than heads each rank keeps a replica, and
        # the MLA latent (one head) is therefore replicated on every rank.
        heads_per_rank = math.ceil(self.num_kv_heads / tp_size)
        # K and V are separate tensors, except MLA's one latent that serves both.
        tensors = 1 if self.kind == "mla" else 2
        return tensors * self.num_layers * heads_per_rank * self.head_dim * element_bytes

    def cached_tokens(self, tokens: int) -> int:
        """Tokens of a ``tokens``-long prefix this group keeps: a sliding window caps them."""
        if self.sliding_window_tokens is None:
            return tokens
        return min(tokens, self.sliding_window_tokens)


@dataclass(frozen=True)
class ModelGeometry:
    """A model's KV-cache layout and the few sizes the FLOP model needs.

    ``num_params`` is the parameter count as published, approximate; for a mixture of experts
    it is the count activated per token, since that is what a forward pass costs.
    """

    name: str
    groups: tuple[KvGroup, ...]
    num_attention_heads: int
    hidden_size: int
    num_params: float
    kv_dtype: KvDtype = "bf16"
    block_size_tokens: int = 16

    def __post_init__(self) -> None:
        # A list would make the frozen geometry unhashable.
        object.__setattr__(self, "groups", tuple(self.groups))
        if not self.groups or not all(isinstance(g, KvGroup) for g in self.groups):
            raise ConfigError(f"model {self.name!r} needs at least one KvGroup")
        for field in ("num_attention_heads", "hidden_size", "block_size_tokens"):
            if not _positive_int(getattr(self, field)):
                raise ConfigError(f"{field} must be an integer >= 1, got {getattr(self, field)!r}")
        dtype_bytes(self.kv_dtype)

    @property
    def num_layers(self) -> int:
        return sum(g.num_layers for g in self.groups)

    def kv_bytes_per_token(self, *, dtype: KvDtype | None = None, tp_size: int = 1) -> int:
        """KV-cache bytes one more token costs, on one tensor-parallel rank.

        Convention: this is the per-token rate of a prefix still shorter than every sliding
        window. Full and MLA layers keep this rate for a prefix of any length; a sliding layer
        stops growing once the prefix reaches its window, so for long prefixes use
        ``kv_bytes(tokens)``, which applies the cap. ``dtype`` overrides ``kv_dtype``.
        """
        _check_tp(tp_size)
        element_bytes = dtype_bytes(self.kv_dtype if dtype is None else dtype)
        return sum(g.bytes_per_token(element_bytes, tp_size) for g in self.groups)

    def kv_bytes(self, tokens: int, *, dtype: KvDtype | None = None, tp_size: int = 1) -> int:
        """KV-cache bytes of a ``tokens``-long prefix on one rank; windows cap sliding groups."""
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise InputError(f"token count must be an integer >= 0, got {tokens!r}")
        _check_tp(tp_size)
        element_bytes = dtype_bytes(self.kv_dtype if dtype is None else dtype)
        return sum(g.bytes_per_token(element_bytes, tp_size) * g.cached_tokens(tokens)
                   for g in self.groups)

    def block_bytes(self, block_tokens: int | None = None, *, dtype: KvDtype | None = None,
                    tp_size: int = 1) -> int:
        """Bytes of one KV block (``block_size_tokens`` by default) on one rank.

        A block is allocated whole, so sliding layers count every token of it: no window cap.
        """
        block_tokens = self.block_size_tokens if block_tokens is None else block_tokens
        if not _positive_int(block_tokens):
            raise ConfigError(f"block size must be an integer >= 1 tokens, got {block_tokens!r}")
        return self.kv_bytes_per_token(dtype=dtype, tp_size=tp_size) * block_tokens

    def with_dtype(self, dtype: KvDtype) -> ModelGeometry:
        """A copy whose KV cache is stored as ``dtype``."""
        return dataclasses.replace(self, kv_dtype=dtype)


def _dense(name: str, layers: int, kv_heads: int, head_dim: int, heads: int, hidden: int,
           params: float) -> ModelGeometry:
    return ModelGeometry(name, (KvGroup.full(layers, kv_heads, head_dim),), heads, hidden, params)


# Published geometry; each source is the model's Hugging Face config.json, the parameter count
# its model card or safetensors total (approximate).
MODELS: dict[str, ModelGeometry] = {
    # meta-llama/Llama-3.1-8B config.json; 131,072 B/token in bf16.
    "llama-3.1-8b": _dense("llama-3.1-8b", 32, 8, 128, 32, 4096, 8.03e9),
    # meta-llama/Llama-3.1-70B config.json; 327,680 B/token in bf16.
    "llama-3.1-70b": _dense("llama-3.1-70b", 80, 8, 128, 64, 8192, 70.6e9),
    # Qwen/Qwen2.5-7B config.json (use_sliding_window false: all layers full); 57,344 B/token.
    "qwen2.5-7b": _dense("qwen2.5-7b", 28, 4, 128, 28, 3584, 7.62e9),
    # Qwen/Qwen2.5-32B config.json; 262,144 B/token.
    "qwen2.5-32b": _dense("qwen2.5-32b", 64, 8, 128, 40, 5120, 32.8e9),
    # Qwen/Qwen2.5-72B config.json; 327,680 B/token.
    "qwen2.5-72b": _dense("qwen2.5-72b", 80, 8, 128, 64, 8192, 72.7e9),
    # mistralai/Mistral-7B-v0.1 config.json: sliding_window 4096 on all 32 layers;
    # 131,072 B/token below the window. Later Mistral-7B versions dropped the window.
    "mistral-7b-v0.1": ModelGeometry(
        "mistral-7b-v0.1", (KvGroup.sliding(32, 8, 128, 4096),), 32, 4096, 7.24e9),
    # codellama/CodeLlama-13b-hf config.json: no GQA, 40 KV heads; 819,200 B/token.
    "codellama-13b": _dense("codellama-13b", 40, 40, 128, 40, 5120, 13.0e9),
    # google/gemma-2-27b config.json: 46 layers alternating sliding (4096) and global;
    # 376,832 B/token below the window.
    "gemma-2-27b": ModelGeometry(
        "gemma-2-27b", (KvGroup.sliding(23, 16, 128, 4096), KvGroup.full(23, 16, 128)),
        32, 4608, 27.2e9),
    # deepseek-ai/DeepSeek-V3 config.json: MLA, kv_lora_rank 512, qk_rope_head_dim 64;
    # 70,272 B/token. 671e9 parameters in all, 37e9 activated per token: the FLOP model needs
    # the activated count. The multi-token-prediction layer is not counted.
    "deepseek-v3": ModelGeometry(
        "deepseek-v3", (KvGroup.mla(61, 512, 64),), 128, 7168, 37e9),
}

# Hugging Face repo ids each registry name answers to.
_HF_IDS: dict[str, tuple[str, ...]] = {
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct",
                     "meta-llama/Meta-Llama-3.1-8B", "meta-llama/Meta-Llama-3.1-8B-Instruct"),
    "llama-3.1-70b": ("meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-70B-Instruct",
                      "meta-llama/Meta-Llama-3.1-70B", "meta-llama/Meta-Llama-3.1-70B-Instruct"),
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-7B-Instruct"),
    "qwen2.5-32b": ("Qwen/Qwen2.5-32B", "Qwen/Qwen2.5-32B-Instruct"),
    "qwen2.5-72b": ("Qwen/Qwen2.5-72B", "Qwen/Qwen2.5-72B-Instruct"),
    "mistral-7b-v0.1": ("mistralai/Mistral-7B-v0.1", "mistralai/Mistral-7B-Instruct-v0.1"),
    "codellama-13b": ("codellama/CodeLlama-13b-hf", "codellama/CodeLlama-13b-Instruct-hf",
                      "codellama/CodeLlama-13b-Python-hf"),
    "gemma-2-27b": ("google/gemma-2-27b", "google/gemma-2-27b-it"),
    # DeepSeek-R1 shares DeepSeek-V3's architecture and config.json geometry.
    "deepseek-v3": ("deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-V3-Base",
                    "deepseek-ai/DeepSeek-R1"),
}


def _lookup_index() -> dict[str, str]:
    # Full repo id and bare repo name both resolve, so "Llama-3.1-8B-Instruct" works alone.
    index = {key: key for key in MODELS}
    for key, repo_ids in _HF_IDS.items():
        for repo_id in repo_ids:
            index[repo_id.lower()] = key
            index[repo_id.rsplit("/", 1)[-1].lower()] = key
    return index


def get_model(name: str) -> ModelGeometry:
    """The registry's geometry for a short name or Hugging Face repo id, case-insensitive."""
    wanted = name.strip().lower()
    index = _lookup_index()
    key = index.get(wanted) or index.get(wanted.rsplit("/", 1)[-1])
    if key is None:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(MODELS)}; "
                          f"for another model pass --model-config config.json")
    return MODELS[key]


def resolve_model(name: str | None = None,
                  config_path: str | Path | None = None) -> ModelGeometry:
    """The geometry to use: ``config_path`` wins, then ``name``, then DEFAULT_MODEL.

    ``name`` is ignored when ``config_path`` is given: the config file names its own model.
    """
    if config_path is not None:
        return from_hf_config(config_path)
    return get_model(DEFAULT_MODEL if name is None else name)


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"model config {str(path)!r} not found; pass a Hugging Face config.json")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise InputError(f"not valid JSON: {err.msg}", path=str(path), line=err.lineno) from None
    except UnicodeDecodeError:
        raise InputError("not UTF-8 text", path=str(path)) from None
    if not isinstance(config, dict):
        raise InputError("a config.json must hold a JSON object", path=str(path))
    return config


class _Reader:
    """Typed access to one config dict; errors name the key and the file."""

    def __init__(self, config: dict[str, Any], source: str | None) -> None:
        self.config, self.source = config, source

    def get(self, key: str) -> Any:
        # HF writes null for an unset option; treat it as absent.
        return self.config.get(key)

    def positive_int(self, key: str, default: int | None = None) -> int:
        value = self.get(key)
        if value is None:
            if default is not None:
                return default
            raise InputError(f"required key {key!r} is missing from the model config",
                             path=self.source, field=key)
        if not _positive_int(value):
            raise InputError(f"{key!r} must be an integer >= 1, got {value!r}",
                             path=self.source, field=key)
        return value


def _layer_kinds(cfg: _Reader, num_layers: int) -> list[str]:
    """Each layer's kind, "full" or "sliding", following the transformers conventions."""
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        return _kinds_from_layer_types(cfg, layer_types, num_layers)
    if cfg.get("sliding_window") is None:
        return ["full"] * num_layers
    if "use_sliding_window" in cfg.config:
        # Qwen2 style: the window applies only when switched on, and then only to layers from
        # max_window_layers up (all layers when that key is absent).
        if not cfg.get("use_sliding_window"):
            return ["full"] * num_layers
        first = cfg.get("max_window_layers") or 0
        return ["full" if i < first else "sliding" for i in range(num_layers)]
    if cfg.get("model_type") == "gemma2":
        # Gemma-2: even layers slide, odd layers attend globally.
        return ["sliding" if i % 2 == 0 else "full" for i in range(num_layers)]
    pattern = cfg.get("sliding_window_pattern")
    if _positive_int(pattern):
        # Gemma-3 style: every pattern-th layer is global.
        return ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers)]
    # Mistral style: a window set at all means every layer slides.
    return ["sliding"] * num_layers


def _kinds_from_layer_types(cfg: _Reader, layer_types: Any, num_layers: int) -> list[str]:
    names = {"full_attention": "full", "sliding_attention": "sliding"}
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise InputError(f"'layer_types' must list one entry for each of {num_layers} layers",
                         path=cfg.source, field="layer_types")
    unknown = sorted({str(t) for t in layer_types if t not in names})
    if unknown:
        raise InputError(f"unsupported layer types {unknown}; supported: {', '.join(names)}",
                         path=cfg.source, field="layer_types")
    return [names[t] for t in layer_types]


def _attention_groups(cfg: _Reader, num_layers: int, heads: int,
                      hidden: int) -> tuple[KvGroup, ...]:
    if cfg.get("kv_lora_rank") is not None:
        # DeepSeek-V2/V3 MLA: every attention layer caches the compressed latent.
        rank = cfg.positive_int("kv_lora_rank")
        return (KvGroup.mla(num_layers, rank, cfg.positive_int("qk_rope_head_dim")),)
    kv_heads = cfg.positive_int("num_key_value_heads", default=heads)
    head_dim = cfg.positive_int("head_dim", default=hidden // heads)
    kinds = _layer_kinds(cfg, num_layers)
    groups = []
    # One group per kind, in order of first appearance; the layers of a kind share a layout.
    for kind in dict.fromkeys(kinds):
        count = kinds.count(kind)
        if kind == "sliding":
            window = cfg.positive_int("sliding_window")
            groups.append(KvGroup.sliding(count, kv_heads, head_dim, window))
        else:
            groups.append(KvGroup.full(count, kv_heads, head_dim))
    return tuple(groups)


def _default_name(config: dict[str, Any], path: Path | None) -> str:
    if isinstance(config.get("_name_or_path"), str) and config["_name_or_path"]:
        return config["_name_or_path"]
    if path is not None:
        # A checkout keeps config.json in a folder named after the model.
        return path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return str(config.get("model_type") or "custom")


def from_hf_config(config: dict[str, Any] | str | Path, *, name: str | None = None,
                   num_params: float | None = None) -> ModelGeometry:
    """Geometry from a Hugging Face ``config.json``, given as a dict or a path.

    Reads layers, KV heads, head size, sliding windows (``layer_types`` first, then the Qwen2,
    Gemma-2, Gemma-3 and Mistral conventions) and MLA (``kv_lora_rank``). The KV dtype follows
    ``torch_dtype``/``dtype`` when that is bf16, fp16 or fp32, else bf16. ``num_params``, when
    not given, is an estimate, 12·layers·hidden², which ignores embeddings and experts.
    """
    path: Path | None = None
    if isinstance(config, dict):
        raw = config
    else:
        path = Path(config)
        raw = _read_config(path)
    # Multimodal configs keep the language model's geometry under text_config.
    text = raw.get("text_config")
    if "num_hidden_layers" not in raw and isinstance(text, dict):
        raw = {**raw, **text}
    cfg = _Reader(raw, None if path is None else str(path))
    num_layers = cfg.positive_int("num_hidden_layers")
    heads = cfg.positive_int("num_attention_heads")
    hidden = cfg.positive_int("hidden_size")
    groups = _attention_groups(cfg, num_layers, heads, hidden)
    hf_dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    return ModelGeometry(
        name=name or _default_name(raw, path),
        groups=groups,
        num_attention_heads=heads,
        hidden_size=hidden,
        num_params=float(12 * num_layers * hidden**2) if num_params is None else num_params,
        kv_dtype=_HF_DTYPES.get(str(hf_dtype), "bf16"),
    )


# -- KV cache groups, as vLLM's hybrid KV-cache manager forms them -------------------------------

@dataclass(frozen=True)
class KvCacheGroup:
    """One KV cache group: layers of one layout sharing one block table (vLLM's KVCacheGroupSpec).

    ``group_idx`` is the index vLLM publishes in its KV events. ``page_layers`` is the group size
    vLLM pads every group to (the layers a block of this group occupies in the shared pool);
    ``layout.num_layers`` are the layers that really cache KV.
    """

    group_idx: int
    layout: KvGroup
    page_layers: int

    @property
    def kind(self) -> str:
        return self.layout.kind

    @property
    def sliding_window_tokens(self) -> int | None:
        return self.layout.sliding_window_tokens

    def bytes_per_token(self, element_bytes: int, tp_size: int = 1) -> int:
        """KV bytes one token adds to this group on one tensor-parallel rank."""
        return self.layout.bytes_per_token(element_bytes, tp_size)


def kv_cache_groups(model: ModelGeometry) -> tuple[KvCacheGroup, ...]:
    """The model's KV cache groups, in the order vLLM numbers them (``group_idx``).

    vLLM 0.32 (vllm/v1/core/kv_cache_utils.py::_get_kv_cache_groups_uniform_page_size) buckets
    layers by spec in order of first appearance, takes the smallest bucket's layer count as the
    group size (the largest one when it is under 1.5 times the smallest), splits each bucket into
    ``ceil(layers / group_size)`` groups taking every ``n``-th layer, and pads each to the group
    size. A model of one layout is one group. All groups share one block pool, so
    ``--num-gpu-blocks-override`` blocks serve every group together (get_kv_cache_config_from_groups).
    """
    counts = [g.num_layers for g in model.groups]
    size = min(counts)
    if max(counts) < size * 1.5:
        size = max(counts)
    out: list[KvCacheGroup] = []
    for bucket in model.groups:
        n = math.ceil(bucket.num_layers / size)
        for i in range(n):
            layers = len(range(i, bucket.num_layers, n))  # layers[i::n]
            out.append(KvCacheGroup(len(out), dataclasses.replace(bucket, num_layers=layers), size))
    return tuple(out)


def kv_groups_from_hf_config(config: dict[str, Any]) -> tuple[KvCacheGroup, ...]:
    """The KV cache groups of a Hugging Face ``config.json`` (a dict), as vLLM forms them.

    Layer kinds follow ``layer_types`` when present, else ``sliding_window`` with
    ``sliding_window_pattern`` (Gemma-3), Gemma-2's alternation, Qwen2's ``use_sliding_window``
    or Mistral's all-sliding convention (``from_hf_config`` reads them).
    """
    return kv_cache_groups(from_hf_config(config))


def group_bytes_per_token(model: ModelGeometry, *, tp_size: int = 1) -> tuple[int, ...]:
    """KV bytes per token of each KV cache group, by ``group_idx``; they sum to kv_bytes_per_token."""
    element_bytes = dtype_bytes(model.kv_dtype)
    return tuple(g.bytes_per_token(element_bytes, tp_size) for g in kv_cache_groups(model))
