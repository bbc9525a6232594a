"""The decoder-only skeleton all supported models share: embed -> N decoder layers -> norm -> LM head.

    h = embed(tokens)
    for each layer:  h = h + attn(norm1(h));  h = h + ffn(norm2(h))      (ffn: dense MLP or MoE)
    logits = lm_head(norm(h))[rows that need logits]

Module names follow the Hugging Face checkpoints (model.layers.{i}.self_attn.q_proj, ...), so most checkpoint
keys are our parameter names; the exceptions (fused experts, fused gate/up) say so in their `weight_specs`.
A model's whole input is a ForwardBatch; its output is float32 logits.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.core.forward_batch import ForwardBatch
from moeserve.core.model_config import ModelConfig
from moeserve.core.tbo_split import should_use_tbo, tbo_enabled
from moeserve.layers.attention.gqa import GQAttention
from moeserve.layers.attention.mla import MLAttention
from moeserve.layers.attention.ops import AttentionMetadata
from moeserve.layers.linear import Embedding, Linear
from moeserve.layers.mlp import GatedMLP
from moeserve.layers.moe.layer import MoE
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.models.tbo import MicroBatchState, run_two_batch_overlap
from moeserve.parallel.state import get_parallel_state

if TYPE_CHECKING:
    from moeserve.args import ServerArgs


class DecoderLayer(nn.Module):
    """Pre-norm block: attention (MLA or GQA) then a dense MLP or an MoE layer, each with a residual."""

    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding, server_args: ServerArgs | None,
                 moe_name: str, expert_names: tuple[str, str, str]):
        super().__init__()
        attention = MLAttention if config.is_mla else GQAttention
        self.self_attn = attention(config, layer_id, rotary)
        self.is_moe = config.is_moe_layer(layer_id)
        self.ffn_name = moe_name if self.is_moe else "mlp"
        ffn = (MoE(config, layer_id, server_args, expert_names) if self.is_moe
               else GatedMLP(config.hidden_size, config.intermediate_size))
        self.add_module(self.ffn_name, ffn)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata, batch: ForwardBatch) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), meta)
        ffn = getattr(self, self.ffn_name)
        x = self.post_attention_layernorm(h)
        return h + (ffn(x, batch) if self.is_moe else ffn(x))

    def stages(self, mb: MicroBatchState, index: int) -> Generator[None, None, None]:
        """The same layer as stages for two-batch overlap (moeserve/models/tbo.py): updates mb.h and yields
        while a dispatch or combine is in flight. `index` (0 = A, 1 = B) picks the MoE dispatcher.

            attention -> [dense MLP]                      (a dense layer: no yield)
            attention -> gate -> dispatch_a    | yield   (dispatch in flight)
            dispatch_b -> experts -> combine_a | yield   (combine in flight)
            shared experts -> combine_b -> residual
        """
        h = mb.h + self.self_attn(self.input_layernorm(mb.h), mb.meta)
        ffn = getattr(self, self.ffn_name)
        x = self.post_attention_layernorm(h)
        if not self.is_moe:
            mb.h = h + ffn(x)
            return
        ffn.op_dispatch_a(x, mb.batch, index)
        yield
        ffn.op_experts(index)
        yield
        mb.h = h + ffn.op_combine(x, index)


class DecoderModel(nn.Module):
    """`model.*` of the checkpoint: embed_tokens, layers, norm."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, server_args: ServerArgs | None,
                 moe_name: str, expert_names: tuple[str, str, str]):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, rotary, server_args, moe_name, expert_names)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """A causal LM over the paged KV cache. Subclasses name the MoE module and the expert tensors."""

    moe_name = "mlp"  # attribute (and checkpoint key part) of a layer's MoE block
    expert_names = ("gate_proj", "up_proj", "down_proj")  # checkpoint names of an expert's three tensors

    def __init__(self, config: ModelConfig, server_args: ServerArgs | None = None):
        super().__init__()
        self.config = config
        rotary_dim = config.qk_rope_head_dim if config.is_mla else config.head_dim
        self.rotary = RotaryEmbedding(rotary_dim, config.rope)
        self.model = DecoderModel(config, self.rotary, server_args, self.moe_name, self.expert_names)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)
        self.tbo_enabled, self.tbo_threshold = tbo_enabled(server_args)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits float32 [len(batch.logits_indices), V], or [T, V] with batch.return_all_logits."""
        rope = self.rotary(batch.positions)
        h = self.model.embed_tokens(batch.input_ids)
        # NOTE: not while a CUDA graph is captured (the split builds small host tensors); graphs run without TBO.
        if (should_use_tbo(batch, self.tbo_enabled, self.tbo_threshold, get_parallel_state().world_size)
                and not (h.is_cuda and torch.cuda.is_current_stream_capturing())):
            h = run_two_batch_overlap(self.model.layers, batch, h, rope)
        else:
            meta = AttentionMetadata.build(batch, rope)
            for layer in self.model.layers:
                h = layer(h, meta, batch)
        if not batch.return_all_logits:
            rows = batch.logits_indices if batch.logits_indices is not None else batch.qo_indptr[1:] - 1
            h = h[rows]
        h = self.model.norm(h)
        w = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        return F.linear(h, w).float()
