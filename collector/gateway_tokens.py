"""Collector (kvlens gateway): a request's prompt token ids, its full blocks hashed as the replica hashes.

Token ids come from the replica's own tokenizer, so they are exactly what the engine will see:

- ``/v1/completions`` with ``prompt`` a list of token ids: those ids (vLLM does not add special
  tokens to a token prompt); a string: ``POST /tokenize`` ``{model, prompt, add_special_tokens}``
  (vLLM's ``TokenizeCompletionRequest``, vllm/entrypoints/serve/tokenize/protocol.py; the
  completion request's own ``add_special_tokens`` default is True, as there);
- ``/v1/chat/completions``: ``POST /tokenize`` with the request's ``messages`` and the fields that
  shape the chat template (``TokenizeChatRequest``: ``add_generation_prompt``,
  ``continue_final_message``, ``add_special_tokens``, ``chat_template``, ``chat_template_kwargs``,
  ``tools``, ``mm_processor_kwargs``), so the template the engine applies is applied here;
- anything else (a batch of prompts, ``n`` > 1 aside, a request without a prompt): no token ids;
  the request is forwarded, not recorded (counted as unrecorded).

Where ``/tokenize`` fails (the replica is not vLLM, or it errs) and the replica's config names a
``tokenizer`` (the model's Hugging Face ``tokenizer.json``), a completion's string prompt is
encoded locally with the ``tokenizers`` library, ``add_special_tokens`` as the request says (vLLM's
``/v1/completions`` encodes with the same fast tokenizer: ``tokenizer(prompt,
add_special_tokens=...)``, vllm/entrypoints/openai/serving_completion.py through its renderer). A
chat request is not encoded locally: its chat template is the engine's, so it stays unrecorded.

The answer is ``{"count", "max_model_len", "tokens"}`` (``TokenizeResponse``). The full blocks
are hashed with collector/hashing.py, the replica's algorithm, seed and block size, the request's
``cache_salt`` (first block) and LoRA (a request whose ``model`` names one of the replica's
``loras``) as vLLM's ``kv_cache_utils.generate_block_hash_extra_keys`` adds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvlens.collector.hashing import content_hashes, token_hashes, vllm_block_hashes
from kvlens.config import ReplicaConfig
from kvlens.errors import ConfigError

__all__ = ["CHAT_TEMPLATE_KEYS", "HashKey", "LocalTokenizer", "block_rows", "direct_token_ids",
           "tokenize_body"]

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
CHAT_TEMPLATE_KEYS = ("add_generation_prompt", "continue_final_message", "add_special_tokens",
                      "chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs")


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int and 0 <= t < 2**32 for t in value)


def direct_token_ids(path: str, body: dict[str, Any]) -> list[int] | None:
    """The prompt's token ids when the request gives them itself (a completion with a token prompt)."""
    if path != COMPLETIONS_PATH:
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and _is_ids(prompt[0]):
        prompt = prompt[0]
    return list(prompt) if _is_ids(prompt) and prompt else None


def tokenize_body(path: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """The replica's ``POST /tokenize`` body for this request; None when it cannot be tokenized alone."""
    if path == CHAT_PATH:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        out = {"messages": messages, **{k: body[k] for k in CHAT_TEMPLATE_KEYS if k in body}}
    elif path == COMPLETIONS_PATH:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return None
        out = {"prompt": prompt, "add_special_tokens": body.get("add_special_tokens", True)}
    else:
        return None
    if isinstance(body.get("model"), str):
        out["model"] = body["model"]
    return out


class LocalTokenizer:
    """A replica's tokenizer.json, for completions when its ``/tokenize`` cannot answer."""

    def __init__(self, path: str, where: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # pragma: no cover - a core dependency
            raise ConfigError(f"{where}: tokenizer = {path} needs the tokenizers package: "
                              "pip install tokenizers") from e
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # the library raises its own Exception for a missing or bad file
            raise ConfigError(f"{where}: tokenizer {path} is not a readable Hugging Face tokenizer.json "
                              f"({str(e).splitlines()[0] if str(e) else type(e).__name__}): "
                              "give the model's tokenizer.json") from e
        self.path = path

    def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The completion prompt's ids as the engine encodes it; None for chat or no string prompt."""
        payload = tokenize_body(path, body) if path == COMPLETIONS_PATH else None
        if payload is None:
            return None
        ids = self._tok.encode(payload["prompt"], add_special_tokens=bool(payload["add_special_tokens"])).ids
        return [int(t) for t in ids] or None


@dataclass(frozen=True)
class HashKey:
    """What a replica's block keys depend on besides the tokens (its engine flags)."""

    block_size: int
    algo: str
    seed: str | None

    @classmethod
    def of(cls, replica: ReplicaConfig) -> HashKey:
        return cls(replica.block_size, replica.hash_algo, replica.hash_seed)


def lora_of(replica: ReplicaConfig, model: Any) -> tuple[str | None, str | None]:
    """(LoRA name, path) when the request's ``model`` is one of the replica's adapters."""
    for name, path in replica.loras:
        if name == model:
            return name, path
    return None, None


def full_block_hashes(tokens: list[int], key: HashKey, *, cache_salt: str | None, lora_name: str | None,
                      lora_path: str | None) -> list[int]:
    """The event-form (uint64) keys of the prompt's full blocks, as the engine computes them."""
    return [b.value for b in vllm_block_hashes(tokens, key.block_size, algo=key.algo, seed=key.seed,
                                               cache_salt=cache_salt, lora_name=lora_name,
                                               lora_path=lora_path)]


def block_rows(request_id: str, arrival_ns: int, tokens: list[int], hashes: list[int], block_size: int,
               namespace: str | None, *, keep_tokens: bool) -> list[dict[str, Any]]:
    """``request_blocks`` rows for the full blocks (as ``kvlens import gateway`` writes from token ids:
    the partial tail has no engine key and is counted from ``prompt_tokens``), with the content and
    token hashes; each block's token ids only when ``keep_tokens``."""
    contents = content_hashes(tokens, block_size) or []
    own = token_hashes(tokens, block_size) or []
    return [{"request_id": request_id, "arrival_ns": arrival_ns, "position": i, "block_hash": h,
             "content_hash": contents[i], "token_hash": own[i], "block_tokens": block_size,
             "block_size_tokens": block_size, "namespace": namespace,
             "token_ids": tokens[i * block_size:(i + 1) * block_size] if keep_tokens else None}
            for i, h in enumerate(hashes)]
