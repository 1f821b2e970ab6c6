"""Tests for collector.hashing: vLLM-compatible block hashes, checked against a real engine's events."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import cbor2
import msgspec
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens.cli import cli
from kvlens.collector.capture import read_capture
from kvlens.collector.hashing import DEFAULT_SEED, content_hashes, event_hash, none_hash, vllm_block_hashes
from kvlens.collector.vllm_events import split_frames
from kvlens.errors import ConfigError

DATA = Path(__file__).parent / "data"
ROOT_SEED0_CBOR = "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"


def test_root_digest_for_sha256_cbor_seed_0() -> None:
    assert none_hash("sha256_cbor", "0").hex() == ROOT_SEED0_CBOR


def test_default_seed_is_vllms_fixed_string() -> None:
    want = hashlib.sha256(pickle.dumps(DEFAULT_SEED, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert none_hash("sha256") == want == none_hash("sha256", None)
    assert none_hash("sha256_cbor") == hashlib.sha256(cbor2.dumps("vllm-none-hash", canonical=True)).digest()


def _capture_stored() -> dict[int, int]:
    """engine hash -> seq of the batch that stored it, from the real vLLM capture head."""
    out: dict[int, int] = {}
    for _, frames in read_capture(DATA / "vllm032_capture_head.frames.jsonl"):
        _, seq, payload = split_frames(frames)
        for ev in msgspec.msgpack.decode(payload)[1]:
            if ev["type"] == "BlockStored":
                for h in ev["block_hashes"]:
                    out.setdefault(h, seq)
    return out


def test_hashes_reproduce_the_engines_events() -> None:
    """Every full block of 12 real prompts hashes to a value the engine published (sha256_cbor, seed 0)."""
    stored = _capture_stored()
    blocks = 0
    for line in (DATA / "vllm032_capture_head.client.jsonl").read_text().splitlines():
        req = json.loads(line)
        hashes = vllm_block_hashes(req["prompt_token_ids"], 32, algo="sha256_cbor", seed="0")
        assert len(hashes) == len(req["prompt_token_ids"]) // 32
        assert all(h.value in stored for h in hashes), req["request_id"]
        # and the engine's own cached_tokens follow: the blocks stored by batches before the one
        # that stored this request's new blocks (no eviction yet in these batches), capped so
        # that at least one prompt token is computed
        seqs = [stored[h.value] for h in hashes]
        prefix = next((i for i, s in enumerate(seqs) if s >= max(seqs)), len(seqs))
        assert min(prefix, (len(req["prompt_token_ids"]) - 1) // 32) * 32 == req["cached_tokens"]
        blocks += len(hashes)
    assert blocks == 117
    # the first request's prompt is exactly the first event's blocks, in order
    first = json.loads((DATA / "vllm032_capture_head.client.jsonl").read_text().splitlines()[0])
    _, _, payload = split_frames(next(read_capture(DATA / "vllm032_capture_head.frames.jsonl"))[1])
    ev = msgspec.msgpack.decode(payload)[1][0]
    assert [h.value for h in vllm_block_hashes(first["prompt_token_ids"], 32, algo="sha256_cbor",
                                               seed="0")] == ev["block_hashes"]


def _first_prompt() -> list[int]:
    first = (DATA / "vllm032_capture_head.client.jsonl").read_text().splitlines()[0]
    return list(json.loads(first)["prompt_token_ids"])


def test_wrong_seed_or_algo_matches_nothing() -> None:
    stored = _capture_stored()
    tokens = _first_prompt()
    for kw in ({"algo": "sha256_cbor", "seed": "1"}, {"algo": "sha256", "seed": "0"},
               {"algo": "sha256_cbor"}):
        assert not any(h.value in stored for h in vllm_block_hashes(tokens, 32, **kw))  # type: ignore[arg-type]


def test_chain_and_event_form_by_hand() -> None:
    tokens = list(range(10))
    got = vllm_block_hashes(tokens, 4, algo="sha256")
    fn = lambda o: hashlib.sha256(pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)).digest()  # noqa: E731
    h0 = fn((fn("vllm-none-hash"), (0, 1, 2, 3), None))
    h1 = fn((h0, (4, 5, 6, 7), None))
    assert [b.digest for b in got] == [h0, h1]  # the tail (8, 9) is not hashed
    assert got[1].value == int.from_bytes(h1, "big") & ((1 << 64) - 1) == event_hash(h1)


def test_extra_keys_lora_every_block_salt_first_block_only() -> None:
    fn = lambda o: hashlib.sha256(cbor2.dumps(o, canonical=True)).digest()  # noqa: E731
    root = fn("0")
    got = vllm_block_hashes([1, 2, 3, 4], 2, algo="sha256_cbor", seed="0", cache_salt="t", lora_name="ad",
                            lora_path="/p")
    h0 = fn((root, (1, 2), (("lora", "ad", "/p"), ("cache_salt", "t"))))
    assert [b.digest for b in got] == [h0, fn((h0, (3, 4), (("lora", "ad", "/p"),)))]
    bare = vllm_block_hashes([1, 2, 3, 4], 2, algo="sha256_cbor", seed="0", cache_salt="t", lora_name="ad",
                             extra_keys_style="bare")
    b0 = fn((root, (1, 2), ("ad", "t")))
    assert [b.digest for b in bare] == [b0, fn((b0, (3, 4), ("ad",)))]


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="xxhash"):
        vllm_block_hashes([1], 1, algo="xxhash")
    with pytest.raises(ConfigError, match="block size"):
        vllm_block_hashes([1], 0)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), max_size=40), st.integers(1, 8), st.integers(0, 40))
def test_chains_are_prefix_closed(tokens: list[int], block: int, cut: int) -> None:
    full = vllm_block_hashes(tokens, block, algo="sha256_cbor", seed="0")
    part = vllm_block_hashes(tokens[:cut], block, algo="sha256_cbor", seed="0")
    assert full[:len(part)] == part
    contents = content_hashes(tokens, block)
    assert contents is not None and content_hashes(tokens[:cut], block) == contents[:len(part)]


def test_content_hash_ignores_keys_but_not_order() -> None:
    a = content_hashes([1, 2, 3, 4], 2)
    assert a is not None and len(a) == 2 and a != content_hashes([3, 4, 1, 2], 2)
    assert content_hashes([1, 2, 3, 4], 2, a[0])[0] != a[0]  # chained on the parent given
    assert content_hashes([-1], 1) is None


def test_hash_command_prints_one_line_per_full_block() -> None:
    tokens = _first_prompt()
    result = CliRunner().invoke(cli, ["hash", "--block-size", "32", "--algo", "sha256_cbor", "--seed", "0"],
                                input=" ".join(map(str, tokens)))
    assert result.exit_code == 0, result.output
    lines = [line.split("\t") for line in result.output.splitlines()]
    want = vllm_block_hashes(tokens, 32, algo="sha256_cbor", seed="0")
    assert [(int(p), d, int(v)) for p, d, v in lines] == [(b.position, b.digest.hex(), b.value) for b in want]
    bad = CliRunner().invoke(cli, ["hash", "--block-size", "2"], input="1 two 3")
    assert bad.exit_code == 1 and "Error:" in bad.output


def test_one_folding_rule_for_signed_and_unsigned_hashes() -> None:
    from kvlens.collector.hashing import fold_u64

    assert [fold_u64(v) for v in (-1, -(2**63), 0, 2**63, 2**64 - 1)] == [
        2**64 - 1, 2**63, 0, 2**63, 2**64 - 1]
