"""Makes a tiny random-weight model and a byte-level BPE tokenizer in a folder, with no download.

The weights are random (seeded): the text it generates is meaningless, but the engine's prefix
cache, block hashing and KV events are real. Two architectures: ``llama`` (dense: one KV cache
group) and ``gemma2`` (hybrid: one sliding-window layer, window 128, and one full-attention
layer, so vLLM's hybrid KV-cache manager keeps two KV cache groups). Run with the engine's own
Python (it needs torch, transformers and tokenizers): python make_tiny_model.py OUT_DIR [ARCH]
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

WORDS = ["the", "cache", "block", "prefix", "token", "replica", "route", "evict", "store", "load", "pool",
         "tenant", "session", "prompt", "system", "user", "assistant", "tool", "answer", "question",
         "request", "engine", "memory", "transfer", "layer"]
# The hybrid model's sliding window, in tokens (the capture's README and the tests rely on it).
GEMMA2_WINDOW = 128


def _tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(2000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    return len(fast)


def main(out: Path, arch: str = "llama") -> None:
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

    vocab = _tokenizer(out)
    common = {"vocab_size": vocab, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
              "max_position_embeddings": 4096, "bos_token_id": 0, "eos_token_id": 1,
              "tie_word_embeddings": True}
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "gemma2":
        config = Gemma2Config(**common, pad_token_id=1, sliding_window=GEMMA2_WINDOW,
                              layer_types=["sliding_attention", "full_attention"])
        model = Gemma2ForCausalLM(config)
    else:
        raise SystemExit(f"unknown architecture {arch!r}: llama or gemma2")
    model.to(torch.bfloat16).save_pretrained(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:3])
