"""Content-addressed page keys: a hash chain over full pages, rooted in the model and the KV layout.

key_0 = H(root || tokens of page 0), key_i = H(key_{i-1} || tokens of page i): a page's key names its whole prefix,
so equal keys mean equal prefixes (up to a 128-bit collision), and a prefix's keys are found page by page.
The root mixes in everything that changes a page's bytes (the weights, the KV dtype and layout, the page size, the
TP shard), so that two models or shardings never read each other's pages. Only full pages have keys.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from moeserve.kvcache.kv_pool import KVPool, MHAKVPool, MLAKVPool

KEY_BYTES = 16  # blake2b digest size: keys are 32 hex characters
WEIGHT_SAMPLE_BYTES = 64 << 10  # read from each end of each weight file for the model's identity
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _hash(*parts: bytes) -> str:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in parts:
        h.update(part)
    return h.hexdigest()


def model_identity(model_path: str | os.PathLike) -> str:
    """A hex digest naming a checkpoint by content: its config.json and, per weight file, its name, size and first
    and last WEIGHT_SAMPLE_BYTES. Stable across restarts and copies; a fine-tune of the same shape differs in its
    sampled bytes. Reads at most 128 KiB per weight file."""
    root = Path(model_path)
    if not (root / "config.json").is_file():
        raise ValueError(f"{root}: no config.json, so no identity for the storage tier's keys")
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update((root / "config.json").read_bytes())
    for path in sorted(p for p in root.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()):
        size = path.stat().st_size
        h.update(f"\0{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            h.update(f.read(WEIGHT_SAMPLE_BYTES))
            f.seek(max(0, size - WEIGHT_SAMPLE_BYTES))
            h.update(f.read(WEIGHT_SAMPLE_BYTES))
    return h.hexdigest()


@dataclass(frozen=True)
class KVLayout:
    """What a page's bytes depend on besides its tokens; its `root()` starts every key chain."""

    model: str  # model_identity(...), or any string naming the weights (a random model's seed)
    dtype: str  # the KV cache dtype, e.g. "bfloat16"
    page_size: int  # tokens per page
    kv_layout: str  # e.g. "mla:61x(512+64)" or "mha:48x8x128/128": layers and per-token shape
    tp_rank: int = 0  # the shard of the KV this rank holds: its rank and size in its attention-TP group
    tp_size: int = 1
    extra: str = ""  # anything else that changes KV values (online quantization of the weights, ...)

    def root(self) -> str:
        return _hash(b"moeserve-kv-page-v1\0", json.dumps(asdict(self), sort_keys=True).encode())

    @classmethod
    def of_pool(cls, pool: KVPool, model: str, tp_rank: int = 0, tp_size: int = 1, extra: str = "") -> KVLayout:
        """The layout of `pool`'s pages on the rank holding shard tp_rank of tp_size."""
        return cls(model, str(pool.dtype).removeprefix("torch."), pool.page_size, kv_layout_name(pool), tp_rank,
                   tp_size, extra)


def kv_layout_name(pool: KVPool) -> str:
    """The per-token shape of `pool`'s pages over all layers, e.g. "mla:61x(512+64)" or "mha:48x4x128/128"."""
    if isinstance(pool, MLAKVPool):
        return f"mla:{pool.num_layers}x({pool.kv_lora_rank}+{pool.qk_rope_head_dim})"
    if isinstance(pool, MHAKVPool):
        return f"mha:{pool.num_layers}x{pool.num_kv_heads}x{pool.head_dim}/{pool.v_head_dim}"
    raise TypeError(f"no storage layout for a {type(pool).__name__}")


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    return np.ascontiguousarray(tokens, dtype="<i8").tobytes()


def next_key(prev_key: str, page_tokens: Sequence[int] | np.ndarray) -> str:
    """The key of the page holding `page_tokens` after the page keyed `prev_key` (the root for the first page)."""
    return _hash(bytes.fromhex(prev_key), _token_bytes(page_tokens))


def page_keys(root: str, tokens: Sequence[int] | np.ndarray, page_size: int) -> list[str]:
    """Keys of the full pages of `tokens` (len(tokens) // page_size of them); a trailing partial page has none.
    `root` starts the chain: a layout's root(), or the key of the page just before `tokens`."""
    assert page_size > 0
    tokens = np.asarray(tokens, dtype=np.int64)
    keys: list[str] = []
    prev = root
    for start in range(0, len(tokens) - page_size + 1, page_size):
        prev = next_key(prev, tokens[start:start + page_size])
        keys.append(prev)
    return keys
