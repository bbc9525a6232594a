"""Content-addressed page keys: a chain over full pages, rooted in the model and the KV layout."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from moeserve.kvcache.kv_pool import MHAKVPool, MLAKVPool
from moeserve.kvcache.storage.keys import KEY_BYTES, KVLayout, model_identity, next_key, page_keys

LAYOUT = KVLayout(model="m" * 32, dtype="bfloat16", page_size=4, kv_layout="mla:2x(16+8)")


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, 50_000, size=n).tolist()


def test_same_prefix_same_keys_and_full_pages_only():
    rng = np.random.default_rng(0)
    tokens = _tokens(rng, 23)
    root = LAYOUT.root()
    keys = page_keys(root, tokens, 4)
    assert len(keys) == 5  # 23 tokens: 5 full pages, the last 3 tokens have no key
    assert all(len(k) == 2 * KEY_BYTES and int(k, 16) >= 0 for k in keys)
    assert len(set(keys)) == 5
    # A longer prompt with the same start shares the start's keys; a list, a tuple and an array agree.
    longer = tokens + _tokens(rng, 9)
    assert page_keys(root, longer, 4)[:5] == keys
    assert page_keys(root, np.array(tokens, dtype=np.int32), 4) == keys == page_keys(root, tuple(tokens), 4)
    assert page_keys(root, tokens[:3], 4) == []


def test_chain_property():
    """key_i = H(key_{i-1} || page i): a key names the whole prefix, and a chain continues from any of its keys."""
    rng = np.random.default_rng(1)
    tokens = _tokens(rng, 16)
    root = LAYOUT.root()
    keys = page_keys(root, tokens, 4)
    expect = root
    for i in range(4):
        page = np.asarray(tokens[4 * i:4 * i + 4], dtype="<i8").tobytes()
        expect = hashlib.blake2b(bytes.fromhex(expect) + page, digest_size=KEY_BYTES).hexdigest()
        assert keys[i] == expect == next_key(keys[i - 1] if i else root, tokens[4 * i:4 * i + 4])
    assert page_keys(keys[1], tokens[8:], 4) == keys[2:]
    # The same page after a different prefix gets a different key.
    other = _tokens(rng, 4) + tokens[4:]
    other_keys = page_keys(root, other, 4)
    assert len(other_keys) == 4 and not set(other_keys) & set(keys)


def test_different_tokens_model_or_layout_differ():
    rng = np.random.default_rng(2)
    tokens = _tokens(rng, 8)
    base = page_keys(LAYOUT.root(), tokens, 4)
    changed = list(tokens)
    changed[5] += 1
    assert page_keys(LAYOUT.root(), changed, 4)[0] == base[0] and page_keys(LAYOUT.root(), changed, 4)[1] != base[1]
    variants = [LAYOUT.__class__(**{**LAYOUT.__dict__, field: value}) for field, value in (
        ("model", "n" * 32), ("dtype", "float8_e4m3fn"), ("kv_layout", "mha:2x2x8/8"), ("tp_rank", 1),
        ("tp_size", 2), ("extra", "fp8-weights"))]
    roots = {v.root() for v in variants} | {LAYOUT.root()}
    assert len(roots) == len(variants) + 1
    for v in variants:
        assert not set(page_keys(v.root(), tokens, 4)) & set(base)
    # The page size changes the pages themselves and the root.
    big = KVLayout(**{**LAYOUT.__dict__, "page_size": 8})
    assert page_keys(big.root(), tokens, 8)[0] not in base


def test_model_identity(tmp_path):
    rng = np.random.default_rng(3)
    a = tmp_path / "a"
    a.mkdir()
    (a / "config.json").write_text('{"hidden_size": 16}')
    weights = rng.integers(0, 256, size=300_000, dtype=np.uint8).tobytes()
    (a / "model.safetensors").write_bytes(weights)
    ident = model_identity(a)
    assert len(ident) == 2 * KEY_BYTES and model_identity(a) == ident
    b = tmp_path / "b"  # a copy elsewhere: the same identity
    b.mkdir()
    (b / "config.json").write_text('{"hidden_size": 16}')
    (b / "model.safetensors").write_bytes(weights)
    assert model_identity(b) == ident
    # A fine-tune (same size, its last bytes differ) and another config differ.
    (b / "model.safetensors").write_bytes(weights[:-10] + bytes(10))
    assert model_identity(b) != ident
    (b / "model.safetensors").write_bytes(weights)
    (b / "config.json").write_text('{"hidden_size": 32}')
    assert model_identity(b) != ident
    with pytest.raises(ValueError, match="config.json"):
        model_identity(tmp_path)


def test_layout_of_pool():
    mla = MLAKVPool(2, 4, 3, kv_lora_rank=16, qk_rope_head_dim=8, dtype=torch.bfloat16, device="cpu")
    mha = MHAKVPool(2, 4, 3, num_kv_heads=2, head_dim=8, v_head_dim=8, dtype=torch.bfloat16, device="cpu")
    a = KVLayout.of_pool(mla, "m")
    assert a == KVLayout("m", "bfloat16", 4, "mla:3x(16+8)")
    b = KVLayout.of_pool(mha, "m", tp_rank=1, tp_size=2)
    assert b.kv_layout == "mha:3x2x8/8" and b.tp_rank == 1 and b.root() != KVLayout.of_pool(mha, "m", 0, 2).root()
    assert a.root() != b.root()
