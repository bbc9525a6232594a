"""The KV cache buffers: one tensor per layer, indexed by token slot.

Slot `s` belongs to page `s // page_size`. Page 0 is never handed out: its slots are a scratch area that padded
rows (CUDA-graph padding, idle ranks) may write without harming anyone.
MLA models store the latent cache (kv_lora_rank + qk_rope_head_dim per token and layer); GQA models store K and V.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moeserve.core.model_config import ModelConfig


class KVPool(ABC):
    """Per-layer KV buffers of `num_slots` token slots (page 0 included)."""

    def __init__(self, num_pages: int, page_size: int, num_layers: int, dtype: torch.dtype, device: torch.device):
        self.num_pages = num_pages  # usable pages, excluding the scratch page 0
        self.page_size = page_size
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_slots = (num_pages + 1) * page_size

    @property
    @abstractmethod
    def bytes_per_token(self) -> int:
        """KV bytes one token takes over all layers."""

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_token * self.num_slots


class MLAKVPool(KVPool):
    """Latent cache for MLA: per layer [num_slots, kv_lora_rank + qk_rope_head_dim] = [c_kv | k_rope]."""

    def __init__(self, num_pages, page_size, num_layers, kv_lora_rank: int, qk_rope_head_dim: int, dtype, device):
        super().__init__(num_pages, page_size, num_layers, dtype, device)
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        dim = kv_lora_rank + qk_rope_head_dim
        self.buffers = [torch.zeros(self.num_slots, dim, dtype=dtype, device=self.device) for _ in range(num_layers)]

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * self.buffers[0].element_size()

    def set_latent(self, layer_id: int, loc: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor) -> None:
        """Write c_kv [T, kv_lora_rank] and k_rope [T, rope_dim] (roped) to slots loc [T]."""
        buf = self.buffers[layer_id]
        buf.index_copy_(0, loc, torch.cat((c_kv, k_rope), dim=-1).to(buf.dtype))  # one copy, one scatter

    def get_latent(self, layer_id: int) -> torch.Tensor:
        """[num_slots, kv_lora_rank + rope_dim] of one layer."""
        return self.buffers[layer_id]


class MHAKVPool(KVPool):
    """K and V caches for GQA: per layer [num_slots, num_kv_heads, head_dim] and [.., v_head_dim]."""

    def __init__(self, num_pages, page_size, num_layers, num_kv_heads: int, head_dim: int, v_head_dim: int,
                 dtype, device):
        super().__init__(num_pages, page_size, num_layers, dtype, device)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim
        shape_k = (self.num_slots, num_kv_heads, head_dim)
        shape_v = (self.num_slots, num_kv_heads, v_head_dim)
        self.k_buffers = [torch.zeros(shape_k, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape_v, dtype=dtype, device=self.device) for _ in range(num_layers)]

    @property
    def bytes_per_token(self) -> int:
        elt = self.k_buffers[0].element_size()
        return self.num_layers * self.num_kv_heads * (self.head_dim + self.v_head_dim) * elt

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k [T, Hkv, D] and v [T, Hkv, Dv] to slots loc [T]."""
        for buf, x in ((self.k_buffers[layer_id], k), (self.v_buffers[layer_id], v)):  # rows of 2-D views
            buf.flatten(1).index_copy_(0, loc, x.flatten(1).to(self.dtype))

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]


def kv_buffers(pool: KVPool) -> list[torch.Tensor]:
    """A KV pool's buffers [num_slots, ...], in one order for every copy of them (PD transfer backends, the host
    tier): per layer the latent (MLA), or K then V."""
    if isinstance(pool, MLAKVPool):
        return list(pool.buffers)
    assert isinstance(pool, MHAKVPool)
    return [b for k, v in zip(pool.k_buffers, pool.v_buffers, strict=True) for b in (k, v)]


def make_kv_pool(config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str, attn_tp_size: int = 1) -> KVPool:
    """The KV pool of `config`'s model on one rank of an attention-TP group of attn_tp_size: MLAKVPool (latent
    cache) or MHAKVPool (this rank's K and V heads)."""
    if config.is_mla:
        return MLAKVPool(num_pages, page_size, config.num_hidden_layers, config.kv_lora_rank,
                         config.qk_rope_head_dim, dtype, device)
    return MHAKVPool(num_pages, page_size, config.num_hidden_layers, config.num_local_kv_heads(attn_tp_size),
                     config.head_dim, config.v_head_dim, dtype, device)
