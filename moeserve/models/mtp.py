"""DeepSeek's multi-token prediction module (MTP; SGLang's NextN): the draft model of speculative decoding.

DeepSeek-V3 and R1 ship one MTP module after the main layers, at L = num_hidden_layers (model.layers.61):

    e  = enorm(embed(t_{i+1}))                      embed: the target's embedding (DeepSeek shares it)
    h  = hnorm(h_i)                                 h_i: the hidden state that fed the head at position i
    h' = Block(eh_proj([e ; h]))                    Block: a full decoder layer (MLA + MoE in V3)
    logits(t_{i+2}) = head(shared_head.norm(h'))    head: the target's LM head (DeepSeek shares it)

Tensors, under model.layers.L.: enorm, hnorm, eh_proj [H, 2H] (bf16 in the FP8 checkpoint), shared_head.norm, the
decoder layer's own (self_attn.*, mlp.*, input_layernorm, post_attention_layernorm), and copies of the target's
embedding (embed_tokens) and head (shared_head.head), which are not read: the target's are used, as SGLang does.

Which convention, checked against SGLang's deepseek_nextn.py and vLLM's deepseek_mtp.py:
- eh_proj's input is [enorm(embedding) ; hnorm(hidden)], the embedding first. (The V3 paper's eq. 21 writes the
  hidden state first; the published weights, and both engines, take the embedding first.)
- h_i is the target's final-normed hidden state (`CausalLM.head_hidden_states`: model.norm of the last layer's
  output), and a chained step takes the previous step's shared_head.norm(h') (SGLang's chaining; vLLM chains h').

The layer is built as layer 0 of a one-layer model (`mtp_config`): its attention writes layer 0 of a KV pool of
its own (`MTPModel.make_kv_pool`), so a draft attends the draft positions written before it. Its MoE runs the
target's dispatcher and kernels with the trivial expert placement: EPLB neither records nor moves its experts.

API for the draft/verify loop (moeserve/rank/):

    mtp = MTPModel(config, options, target)     # target: the CausalLM; shares its embedding, rotary and head
    pool = mtp.make_kv_pool(num_pages, page_size, dtype, device, attn_tp_size)
    h = target.head_hidden_states(batch)        # [T, H], every row of the target's step
    logits, h_next = mtp(draft_batch, input_ids, h)

draft_batch is a ForwardBatch over `pool` (its positions, slots and lengths; EXTEND or DECODE). input_ids [T] int64
and hidden [T, H] are row-aligned: row r pairs the token after position p_r with the hidden state of position p_r,
and writes the draft KV of position p_r. logits: float32 [len(logits_indices), V] (or [T, V] with
return_all_logits) predict the token after input_ids; h_next [T, H] is every row's hidden state for the next step.
One way to lay out the slots: the draft pool as large as the target's, a position's draft KV in the slot its target
KV has, so the target's page tables serve both. Its bytes per token: mtp.config.kv_bytes_per_token(dtype, attn_tp)
(one layer's). An IDLE batch (no rows, hidden [0, H]) runs the layer's MoE collectives, as the target's does.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moeserve.core.forward_batch import ForwardBatch
from moeserve.core.model_config import ModelConfig
from moeserve.ep.base import Dispatcher
from moeserve.kvcache.kv_pool import KVPool
from moeserve.kvcache.kv_pool import make_kv_pool as make_pool
from moeserve.layers.attention.ops import AttentionMetadata
from moeserve.layers.linear import Linear
from moeserve.layers.moe.layer import MoE
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.models.decoder import CausalLM, DecoderLayer, logit_rows
from moeserve.models.options import ModelOptions

MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")  # families whose checkpoints may carry MTP
SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # the target's own tensors, copied: not read


def check_mtp_support(config: ModelConfig) -> None:
    """ValueError unless `config`'s model can draft with its own MTP layer: a DeepSeek family whose config.json
    declares one (num_nextn_predict_layers 1)."""
    if config.architecture not in MTP_ARCHITECTURES:
        raise ValueError(f"speculative decoding drafts with DeepSeek's multi-token-prediction layer; "
                         f"{config.architecture} has none (supported: {', '.join(MTP_ARCHITECTURES)})")
    if config.num_mtp_layers == 0:
        raise ValueError(f"speculative decoding drafts with the model's multi-token-prediction layer, but "
                         f"{config.path or 'the model'}'s config.json has num_nextn_predict_layers 0 (or none): this "
                         "checkpoint has no MTP weights (DeepSeek-V3 and R1 ship one, model.layers.61)")
    if config.num_mtp_layers > 1:
        raise ValueError(f"num_nextn_predict_layers {config.num_mtp_layers}: moeserve drafts with one MTP layer "
                         "(as DeepSeek publishes them)")


def mtp_config(config: ModelConfig) -> ModelConfig:
    """The MTP layer as layer 0 of a one-layer model: its attention's KV-pool layer, and whether its FFN is an
    MoE (by the main layers' rule at index num_hidden_layers)."""
    return dataclasses.replace(config, num_hidden_layers=1, moe_layers=(0,) if config.mtp_is_moe else (),
                               num_mtp_layers=0)


def mtp_layer_prefix(config: ModelConfig) -> str:
    """The checkpoint prefix of the MTP layer: model.layers.{num_hidden_layers}."""
    return f"model.layers.{config.num_hidden_layers}"


class MTPLayer(DecoderLayer):
    """model.layers.L: a decoder layer of the target's family, with the MTP module's norms and projection."""

    def __init__(self, model_cls: type[CausalLM], config: ModelConfig, rotary: RotaryEmbedding,
                 options: ModelOptions):
        """config: the one-layer view (`mtp_config`)."""
        super().__init__(model_cls, config, 0, rotary, options)
        H, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(H, eps)
        self.hnorm = RMSNorm(H, eps)
        self.eh_proj = Linear(2 * H, H)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(H, eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                batch: ForwardBatch) -> torch.Tensor:
        """Token embeddings [T, H] and hidden states [T, H] -> shared_head.norm(h') [T, H]."""
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))
        out, residual = super().forward(x, meta, batch)
        return self.shared_head.norm(out, residual)[0]


class MTPModel(nn.Module):
    """The draft model: the checkpoint's MTP layer over the target's embedding, rotary and LM head."""

    def __init__(self, config: ModelConfig, options: ModelOptions | None, target: CausalLM):
        super().__init__()
        check_mtp_support(config)
        options = options or ModelOptions()
        self.config = mtp_config(config)
        self.prefix = mtp_layer_prefix(config)
        # NOTE: not a submodule: the target's parameters are neither the draft's to load nor to count
        object.__setattr__(self, "target", target)
        # the trivial placement, no rebalance: EPLB's maps and recorder cover the main layers only; one dispatcher
        moe = dataclasses.replace(options.moe, placement=None, num_redundant_experts=0, rebalance=False,
                                  dynamic_dispatch=False, two_batch_overlap=False)
        own = dataclasses.replace(options, moe=moe, two_batch_overlap=False)
        self.model = nn.Module()  # parameter names are the checkpoint's: model.layers.L.*
        self.model.layers = nn.ModuleDict(
            {self.prefix.rpartition(".")[2]: MTPLayer(type(target), self.config, target.rotary, own)})
        for m in self.moe_layers():
            m.gate.fake = options.fake_routing

    @property
    def layer(self) -> MTPLayer:
        return next(iter(self.model.layers.values()))

    def forward(self, batch: ForwardBatch, input_ids: torch.Tensor, hidden: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits float32 [len(batch.logits_indices), V] or [T, V], h_next [T, H]): see the module docstring."""
        target = self.target
        meta = AttentionMetadata.build(batch, target.rotary(batch.positions))
        h = self.layer(target.model.embed_tokens(input_ids), hidden, meta, batch)
        return target.head_logits(logit_rows(h, batch)), h

    def make_kv_pool(self, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device | str,
                     attn_tp_size: int = 1) -> KVPool:
        """The MTP layer's own KV pool (one layer), of the target's pool's kind."""
        return make_pool(self.config, num_pages, page_size, dtype, device, attn_tp_size)

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def dispatchers(self) -> list[Dispatcher]:
        """The MTP layer's MoE dispatchers (built at load), for the model runner's collectives."""
        return [d for m in self.moe_layers() for d in m.dispatchers]
