"""Makes a tiny random-weight Llama and a byte-level BPE tokenizer in a folder, with no download.

The weights are random (seeded): the text it generates is meaningless, but the engine's prefix
cache, block hashing and KV events are real. Run with the engine's own Python (it needs torch,
transformers and tokenizers): python make_tiny_model.py OUT_DIR
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

WORDS = ["the", "cache", "block", "prefix", "token", "replica", "route", "evict", "store", "load", "pool",
         "tenant", "session", "prompt", "system", "user", "assistant", "tool", "answer", "question",
         "request", "engine", "memory", "transfer", "layer"]


def main(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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
    config = LlamaConfig(vocab_size=len(fast), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
