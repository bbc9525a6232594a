"""The decoder-only skeleton all supported models share: embed -> N decoder layers -> norm -> LM head.

    h = embed(tokens)
    for each layer:  h = h + attn(norm1(h));  h = h + ffn(norm2(h))      (ffn: dense MLP or MoE)
    logits = lm_head(norm(h))[rows that need logits]

With --enable-dp-lm-head and several ranks per attention group, each rank holds 1/n of the LM head's vocabulary rows
and the group gathers the logits: no DP group waits on another (SGLang's DP LM head).

Each residual add is left to the norm after it, which fuses it into its pass (the Triton RMSNorm on CUDA): a layer
returns its FFN output and the residual apart, and the last one's are added once.

A model file (deepseek.py, qwen3_moe.py, mixtral.py) subclasses CausalLM and says what differs: its attention
(`attention_class`), its MoE gate (`make_gate`) and the checkpoint names of its MoE block and experts.
Module names follow the Hugging Face checkpoints (model.layers.{i}.self_attn.q_proj, ...), so most checkpoint
keys are our parameter names; the exceptions (fused experts, fused gate/up) say so in their `weight_specs`.
A model's whole input is a ForwardBatch; its output is float32 logits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Generator

import torch
from torch import nn

from moeserve.core.forward_batch import ForwardBatch
from moeserve.core.model_config import ModelConfig
from moeserve.core.tbo_split import should_use_tbo
from moeserve.ep.base import Dispatcher
from moeserve.kernels.skinny_gemm import skinny_gemm
from moeserve.layers.attention.ops import AttentionMetadata, PieceSplitter
from moeserve.layers.linear import ColumnParallelLinear, Embedding, Linear
from moeserve.layers.mlp import GatedMLP
from moeserve.layers.moe.layer import ExpertRecorder, MoE
from moeserve.layers.moe.token_split import TokenSplit
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.layers.weights import shard
from moeserve.models.options import ModelOptions
from moeserve.models.tbo import MicroBatchState, run_two_batch_overlap
from moeserve.parallel.comm import all_gather
from moeserve.parallel.state import get_parallel_state


def logit_rows(h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """The rows of h [T, H] that need logits: batch.logits_indices (each request's last token by default), or
    all of them with batch.return_all_logits."""
    if batch.return_all_logits:
        return h
    return h[batch.logits_indices if batch.logits_indices is not None else batch.qo_indptr[1:] - 1]


class DecoderLayer(nn.Module):
    """Pre-norm block: attention then a dense MLP or an MoE layer, each with a residual."""

    def __init__(self, model_cls: type[CausalLM], config: ModelConfig, layer_id: int, rotary: RotaryEmbedding,
                 options: ModelOptions):
        super().__init__()
        self.self_attn = model_cls.attention_class(config)(config, layer_id, rotary)
        self.is_moe = config.is_moe_layer(layer_id)
        self.ffn_name = model_cls.moe_name if self.is_moe else "mlp"
        ffn = (MoE(config, layer_id, model_cls.make_gate(config), options.moe, model_cls.expert_names)
               if self.is_moe else GatedMLP(config.hidden_size, config.intermediate_size))
        self.add_module(self.ffn_name, ffn)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata, batch: ForwardBatch,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, residual): the layer's output is out + residual, the add left to the next norm (fused into its
        pass). residual None: h is the whole input (the first layer)."""
        x, residual = self._attention(h, residual, meta)
        ffn = getattr(self, self.ffn_name)
        return (ffn(x, batch) if self.is_moe else ffn(x)), residual

    def _attention(self, h: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(h + residual) -> attention -> (the FFN's input, the residual after attention's add)."""
        quantize = self.self_attn.quantized_input  # FP8 projections first: the norm quantizes its output
        x, residual = ((self.input_layernorm(h, quantize=quantize), h) if residual is None
                       else self.input_layernorm(h, residual, quantize=quantize))
        return self.post_attention_layernorm(self.self_attn(x, meta), residual=residual)

    def stages(self, mb: MicroBatchState, index: int) -> Generator[None, None, None]:
        """forward as stages for two-batch overlap (moeserve/models/tbo.py): updates mb.h and mb.residual (as
        forward returns them) and yields while a dispatch or combine is in flight. `index` (0 = A, 1 = B) picks the
        MoE layer's dispatcher.

            attention -> [dense MLP]                      (a dense layer: no yield)
            attention -> MoE.dispatch            | yield   (dispatch in flight)
            MoE.compute                          | yield   (combine in flight)
            MoE.combine
        """
        x, residual = self._attention(mb.h, mb.residual, mb.meta)
        ffn = getattr(self, self.ffn_name)
        if not self.is_moe:
            mb.h, mb.residual = ffn(x), residual
            return
        ffn.dispatch(x, mb.batch, index)
        yield
        ffn.compute(index)
        yield
        mb.h, mb.residual = ffn.combine(x, index), residual


class DecoderModel(nn.Module):
    """`model.*` of the checkpoint: embed_tokens, layers, norm."""

    def __init__(self, model_cls: type[CausalLM], config: ModelConfig, rotary: RotaryEmbedding,
                 options: ModelOptions):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(model_cls, config, i, rotary, options) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """A causal LM over the paged KV cache. Subclasses say what their family's layers are."""

    moe_name = "mlp"  # attribute (and checkpoint key part) of a layer's MoE block
    expert_names = ("gate_proj", "up_proj", "down_proj")  # checkpoint names of an expert's three tensors

    @staticmethod
    def attention_class(config: ModelConfig) -> type[nn.Module]:
        """The attention module: built as cls(config, layer_id, rotary)."""
        raise NotImplementedError

    @staticmethod
    def make_gate(config: ModelConfig) -> nn.Module:
        """The MoE gate: x [T, H] -> (logical topk_ids [T, k], topk_weights [T, k])."""
        raise NotImplementedError

    @staticmethod
    def rotary_dim(config: ModelConfig) -> int:
        return config.head_dim

    def __init__(self, config: ModelConfig, options: ModelOptions | None = None):
        super().__init__()
        options = options or ModelOptions()
        self.config = config
        self.options = options  # what a draft model on this one runs with (models/mtp.py)
        self.rotary = RotaryEmbedding(self.rotary_dim(config), config.rope)
        self.model = DecoderModel(type(self), config, self.rotary, options)
        self._make_lm_head(config, options.dp_lm_head)
        self.tbo_enabled, self.tbo_threshold = options.two_batch_overlap, options.tbo_token_threshold
        self.tbo_steps: Counter[tuple[int, bool]] = Counter()  # (largest group's tokens, overlapped): steps
        self.expert_location = options.moe.placement  # the placement in force (None: trivial); EPLB updates it
        for moe in self.moe_layers():
            moe.gate.fake = options.fake_routing
        # the recorder's on_pass_begin (moeserve/eplb/recorder.py), told which rows of a pass are real tokens, and
        # the MoE layers' token split (the rows this rank routes)
        self._mark_real_rows: Callable[[torch.Tensor | None], None] | None = None
        self._moe_split: TokenSplit | None = None

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits float32 [len(batch.logits_indices), V], or [T, V] with batch.return_all_logits."""
        return self.compute_logits(self.hidden_states(batch), batch)

    def hidden_states(self, batch: ForwardBatch, pieces: PieceSplitter | None = None) -> torch.Tensor:
        """The last layer's output [T, H] (before the final norm). pieces: a piecewise CUDA-graph capture, which
        every layer's attention runs through (moeserve/rank/piecewise_graph_runner.py)."""
        rope = self.rotary(batch.positions)
        h = self.model.embed_tokens(batch.input_ids)
        if self._mark_real_rows is not None:  # padding rows (CUDA graphs) write to the scratch slot 0
            real = batch.out_cache_loc != 0 if batch.out_cache_loc is not None else None
            self._mark_real_rows(None if real is None else self._moe_split.own(real))
        # While a CUDA graph is captured only a decode step splits (from views: core/tbo_split.py's _split_decode);
        # an extend's split builds small host tensors, so a piecewise-captured extend runs without TBO.
        tbo = (pieces is None and should_use_tbo(batch, self.tbo_enabled, self.tbo_threshold,
                                                 get_parallel_state().world_size)
               and (batch.mode.is_decode or not (h.is_cuda and torch.cuda.is_current_stream_capturing())))
        if self.tbo_enabled:  # the decision per step, as /get_load's step_counts shows it
            self.tbo_steps[max(batch.global_num_tokens or [batch.num_tokens]), tbo] += 1
        if tbo:
            return run_two_batch_overlap(self.model.layers, batch, h, rope)
        meta = AttentionMetadata.build(batch, rope)
        meta.pieces = pieces
        residual = None
        for layer in self.model.layers:
            h, residual = layer(h, meta, batch, residual)
        return h + residual

    def _make_lm_head(self, config: ModelConfig, vocab_parallel: bool) -> None:
        """lm_head [V, H] (None: tied to the embeddings). vocab_parallel: this rank's rows `vocab_rows` of it, the
        logits gathered over `vocab_group` (the attention-TP group), where that group has several ranks."""
        ps = get_parallel_state()
        self.vocab_group = self.vocab_rows = None
        if vocab_parallel and ps.attn_tp_size > 1:
            if config.vocab_size % ps.attn_tp_size:
                raise ValueError(f"--enable-dp-lm-head splits the vocabulary ({config.vocab_size}) over the "
                                 f"{ps.attn_tp_size} ranks of an attention group: it must be a multiple of them")
            self.vocab_group = ps.attn_tp_group
            self.vocab_rows = shard(config.vocab_size, ps.attn_tp_size, ps.attn_tp_rank)
        H, V = config.hidden_size, config.vocab_size
        if config.tie_word_embeddings:
            self.lm_head = None
        elif self.vocab_group is not None:
            self.lm_head = ColumnParallelLinear(H, V, tp_size=ps.attn_tp_size, tp_rank=ps.attn_tp_rank)
        else:
            self.lm_head = Linear(H, V)

    def compute_logits(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits of the rows of h [T, H] that need them: the final norm, then the LM head."""
        return self.head_logits(self.model.norm(logit_rows(h, batch)))

    def head_hidden_states(self, batch: ForwardBatch) -> torch.Tensor:
        """The final-normed hidden states [T, H] of every row: what the LM head reads, and what DeepSeek's MTP
        module (models/mtp.py) takes as the target's hidden state."""
        return self.model.norm(self.hidden_states(batch))

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, V] of normed hidden states h [N, H] (the LM head alone; gathered over the vocabulary
        group with --enable-dp-lm-head). The MTP module reads it too: DeepSeek shares the head."""
        if self.lm_head is not None:
            w = self.lm_head.weight
        else:  # tied: this rank's rows of the embeddings
            w = self.model.embed_tokens.weight
            w = w[self.vocab_rows] if self.vocab_rows is not None else w
        logits = skinny_gemm(h, w)
        return (all_gather(logits, self.vocab_group, dim=-1) if self.vocab_group is not None else logits).float()

    # ------------------------------------------------------------------ what the model runner asks
    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def dispatchers(self) -> list[Dispatcher]:
        """Every MoE layer's dispatchers (one per micro-batch), built at load."""
        return [d for m in self.moe_layers() for d in m.dispatchers]

    def set_expert_recorder(self, recorder: ExpertRecorder | None) -> None:
        """Every MoE layer reports its chosen logical experts to `recorder` (None: stop); a recorder with
        on_pass_begin (moeserve/eplb/recorder.py) is told before each pass which rows are real tokens."""
        self._mark_real_rows = getattr(recorder, "on_pass_begin", None)
        self._moe_split = self.moe_layers()[0].split if self.moe_layers() else None
        for m in self.moe_layers():
            m.set_recorder(recorder)
