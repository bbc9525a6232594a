"""DeepSeek-V2 and DeepSeek-V3: Multi-head Latent Attention, then a dense MLP (first_k_dense_replace layers) or an
MoE layer with shared experts and a grouped gate.

Attention (MLA), over one latent cache [c_kv | k_rope] per token:

    q      = W_UQ · norm(W_DQ · x)            (or W_Q · x without q_lora)      -> [q_nope | q_rope] per head
    c_kv   = norm(W_DKV · x),  k_rope = RoPE(W_KR · x)                          -> cached, shared by all heads
    k_nope = W_UK · c_kv,      v = W_UV · c_kv                                  (kv_b_proj = [W_UK; W_UV] per head)
    o      = W_O · softmax(scale · (q_nope·k_nope + q_rope·k_rope)) v

EXTEND runs the expanded form: the latent of the whole sequence is read back from the cache and expanded to
per-head k_nope and v (multi-head attention with qk dim nope+rope and v dim v_head_dim). DECODE runs the
weight-absorbed form: q_nope · k_nope = (q_nope W_UK) · c_kv, so the query moves into the latent space and
attention is multi-query over the cache itself ([c_kv | k_rope] as key, c_kv as value); the output comes back
through W_UV. On the CPU an EXTEND runs absorbed too where that costs less (a short tail over a long cached
prefix: layers/attention/latent_extend.py), so the prefix is not expanded again every step.

The MoE gate (`deepseek_gate`): scores s = softmax(x W_g^T) (V2) or sigmoid(x W_g^T) (V3); the experts fall into
n_group groups and only the topk_group best groups are eligible:
- V2 greedy (V2-Lite): top-k of s, no groups;
- V2 group_limited_greedy: groups ranked by their best expert's score;
- V3 noaux_tc: a per-expert bias b (e_score_correction_bias) only chooses: groups ranked by the sum of their two best
  s + b, then the top-k of s + b among the kept groups; the weights are the unbiased s, renormalized to sum to 1.
Then the weights are multiplied by routed_scaling_factor (2.5 in V3). The MoE block adds n_shared_experts
always-on experts: y = sum_k w_k E_k(x) + S(x) (moeserve/layers/moe/layer.py).

Both versions use the same modules; what differs comes from the config (V3: rope pairs interleaved per
rope_interleave; V2: YaRN with mscale folded into the softmax scale).
NOTE: transformers' DeepseekV2TopkRouter ignores norm_topk_prob; we honour it (as DeepSeek's own code does).
Released V2 checkpoints have norm_topk_prob false, where the two agree.
The MTP layer (model.layers.{num_hidden_layers}) is not part of this model: models/mtp.py builds it apart, as the
draft model of speculative decoding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moeserve.core.derived import derived
from moeserve.core.model_config import ModelConfig
from moeserve.kernels.cpu_skinny_gemm import pack_groups
from moeserve.kernels.fp8_quant import BLOCK, QuantizedRows
from moeserve.kernels.mla_rope_cache import mla_rope_cache
from moeserve.kernels.skinny_gemm import batched_skinny_gemm
from moeserve.layers.attention.latent_decode import LatentDecode, latent_to_heads, pick_latent_decode
from moeserve.layers.attention.latent_extend import MLAShape, absorbed_extend, absorbed_requests
from moeserve.layers.attention.ops import AttentionMetadata, attend_parts, extend_attention
from moeserve.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from moeserve.layers.moe.router import TopKRouter
from moeserve.layers.norm import RMSNorm
from moeserve.layers.quantization.fp8_linear import Fp8ColumnParallelLinear, Fp8Linear
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.models.decoder import CausalLM
from moeserve.parallel.state import get_parallel_state

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm use the default eps, not rms_norm_eps


class MLAttention(nn.Module):
    """MLA with this rank's share of the heads (heads split over the attention-TP group)."""

    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        ps = get_parallel_state()
        tp, rank = ps.attn_tp_size, ps.attn_tp_rank
        self.layer_id = layer_id
        self.rotary = rotary  # shared by all layers; held only for `apply`
        hidden, heads = config.hidden_size, config.num_attention_heads
        assert heads % tp == 0, f"{heads} attention heads do not split over {tp} ranks"
        self.num_heads = heads // tp
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        qk_dim = self.nope_dim + self.rope_dim
        self.shape = MLAShape(self.num_heads, self.kv_lora_rank, self.rope_dim, self.nope_dim, self.v_dim)
        self.scale = config.softmax_scale
        bias = config.attention_bias

        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk_dim, False, tp, rank)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk_dim, False, tp, rank)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope_dim, bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (self.nope_dim + self.v_dim), False, tp, rank)
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias, tp, rank, ps.attn_tp_group)
        self._extend_absorbable = True  # (process_weights_after_loading: False for an FP8 kv_b_proj)
        self.latent_decode: LatentDecode | None = None  # DECODE's kernel (layers/attention/latent_decode.py): at load
        self._qkv_a: Callable[[torch.Tensor], torch.Tensor] | None = None  # x's two projections in one GEMM: at load
        # Set at load: x's projections multiply in FP8, so the norm before this layer hands x over quantized
        # (kernels/rms_norm.py rms_norm_quant: no quantizer launch of its own); and so does q's latent norm for an
        # FP8 q_b_proj.
        self.quantized_input = False
        self._q_b_fp8 = False

    def forward(self, x: torch.Tensor | QuantizedRows, meta: AttentionMetadata) -> torch.Tensor:
        """x [T, H] -> [T, H]; writes this step's latents to the cache first. x comes quantized (QuantizedRows)
        where `quantized_input` says so."""
        T = x.shape[0]
        if T == 0:
            return self.kv_a_layernorm.weight.new_empty(0, self.o_proj.out_features)
        q, kv_a = self._down_projections(x)  # q (or its latent) and [c_kv | k_rope]
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q, quantize=self._q_b_fp8))
        q_nope, q_rope = q.view(T, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_rope = kv_a.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        # cache[loc] = [norm(c_kv) | rope(k_rope)] and q_rope roped, in one kernel on CUDA
        norm = self.kv_a_layernorm
        q_rope = mla_rope_cache(q_rope, c_kv, k_rope, norm.weight, norm.eps, meta.rope, self.rotary.interleaved,
                                meta.kv_pool.get_latent(self.layer_id), meta.out_cache_loc)
        o = attend_parts(meta, self._attend, q_nope, q_rope)  # [T, h, v]
        return self.o_proj(o.reshape(T, self.num_heads * self.v_dim))

    def _attend(self, q_nope: torch.Tensor, q_rope: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One EXTEND or DECODE part -> [t, h, v]: decode absorbed into the latent space, extend expanded, or
        absorbed where that costs fewer multiply-adds (layers/attention/latent_extend.py)."""
        cache = meta.kv_pool.get_latent(self.layer_id)  # [N, r + rope]
        if meta.mode.is_decode:  # q_nope W_UK against c_kv, all heads over one latent head, back through W_UV
            w_uk, w_uv = self._kv_b()
            uk_packed, uv_packed = self._kv_b_packed()
            q_latent = batched_skinny_gemm(q_nope.transpose(0, 1), w_uk.transpose(1, 2),
                                           packed=uk_packed).transpose(0, 1)
            return latent_to_heads(self.latent_decode(q_latent, q_rope, cache, meta, self.scale), w_uv, uv_packed)
        key = ("absorbed", self.shape)  # the step's choice, made by its first MLA layer for all of them
        forms = meta.memo.get(key)
        if forms is None:
            forms = [False] * len(meta.extend_lens)
            if self._extend_absorbable:
                forms = absorbed_requests(self.shape, meta.extend_plan, meta.extend_lens, meta.seq_lens, q_nope)
            meta.memo[key] = forms
        if all(forms):
            return self._absorbed(q_nope, q_rope, cache, meta)
        if not any(forms):
            return self._expanded(q_nope, q_rope, cache, meta)
        parts_key = ("absorbed parts", self.shape)  # requests of both forms: each form over its own requests
        parts = meta.memo.get(parts_key)
        if parts is None:
            parts = meta.memo[parts_key] = [
                (*meta.select([b for b, f in enumerate(forms) if f == form]), form) for form in (True, False)]
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_dim)
        for rows, part, absorbed in parts:
            attend = self._absorbed if absorbed else self._expanded
            out[rows] = attend(q_nope[rows], q_rope[rows], cache, part)
        return out

    def _absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        """A short tail over a long prefix: the decode's absorbed form, causal over each request's rows."""
        w_uk, w_uv = self._kv_b()
        return absorbed_extend(q_nope, q_rope, cache, meta.kv_indices, meta.kv_indptr, w_uk, w_uv, meta.extend_plan,
                               meta.extend_lens, self.scale, packed=self._kv_b_packed())

    def _expanded(self, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        """Every latent of the sequences expanded through kv_b_proj into per-head k_nope and v."""
        c_kv, k_rope = cache[meta.kv_indices].to(q_nope.dtype).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c_kv).view(c_kv.shape[0], self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # [S, h, nope], [S, h, v]
        return extend_attention(q_nope, k_nope, v, meta.extend_lens, meta.seq_lens, self.scale,
                                plan=meta.extend_plan, q_rope=q_rope, k_rope=k_rope)

    def process_weights_after_loading(self, device: torch.device) -> None:
        """The absorbed decode multiplies by W_UK and W_UV directly: kv_b_proj's weight as a plain matrix (the
        parameter itself; FP8 weights dequantized once into the activations' dtype, as SGLang keeps w_kc / w_vc).
        The decode kernel is picked here, for the device and the cache's dtype."""
        dtype = self.kv_a_layernorm.weight.dtype  # the activations' and the KV pool's
        self._kv_b_dense = self.kv_b_proj.dense_weight(dtype)
        # an FP8 kv_b_proj keeps every extend expanded, as on CUDA: the expanded form quantizes its input per
        # 128-block and the absorbed one multiplies the dequantized weight, an e4m3 step apart, so a prompt's
        # rounding would follow how it was chunked (2 DP ranks against 1 parted by 0.032 in a log-prob)
        self._extend_absorbable = not isinstance(self.kv_b_proj, Fp8Linear | Fp8ColumnParallelLinear)
        self._qkv_a = self._fuse_qkv_a(device)
        self.quantized_input = self._x_projections_fp8()
        self._q_b_fp8 = self.q_lora_rank is not None and isinstance(self.q_b_proj, Fp8ColumnParallelLinear)
        self.latent_decode = pick_latent_decode(device, dtype)

    def _down_projections(self, x: torch.Tensor | QuantizedRows) -> tuple[torch.Tensor, torch.Tensor]:
        """(q or q's latent, kv_a): the two projections of x, in one GEMM where they are fused."""
        first, second = self._x_projections()
        if self._qkv_a is None:
            return first(x), second(x)
        return self._qkv_a(x).split([first.out_features, second.out_features], -1)

    def _x_projections(self) -> tuple[Linear, Linear]:
        """The layers that read x: q_proj (or q_a_proj, q's latent) and kv_a_proj_with_mqa."""
        return (self.q_proj if self.q_lora_rank is None else self.q_a_proj), self.kv_a_proj_with_mqa

    def _x_projections_fp8(self) -> bool:
        """Both layers that read x multiply in FP8."""
        return all(isinstance(p, Fp8Linear | Fp8ColumnParallelLinear) for p in self._x_projections())

    def _fuse_qkv_a(self, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """q_proj (or q_a_proj) and kv_a_proj_with_mqa both read x: their weights as one [q rows + kv_a rows, H]
        matrix, the two layers' parameters becoming views of it (no memory added), as SGLang's
        fused_qkv_a_proj_with_mqa: one GEMM, and with FP8 one quantization of x. Plain weights, or FP8 ones whose
        q rows are whole 128-blocks (so the scale blocks concatenate too); no bias. The fused layer's matmul, or
        None where the two run apart."""
        parts = self._x_projections()
        first = parts[0]
        plain = all(type(p)._matmul is Linear._matmul for p in parts)
        fp8 = self._x_projections_fp8() and first.out_features % BLOCK == 0
        if not (plain or fp8) or any(p.bias is not None for p in parts):
            return None
        names = ("weight",) if plain else ("weight", "weight_scale_inv")
        with torch.device("meta"):
            fused = (Linear if plain else Fp8Linear)(first.in_features, sum(p.out_features for p in parts), **(
                {} if plain else {"activation_dtype": first.activation_dtype}))
        for name in names:
            whole = torch.cat([getattr(p, name).data for p in parts])
            setattr(fused, name, nn.Parameter(whole, requires_grad=False))
            at = 0
            for p in parts:
                n = getattr(p, name).shape[0]
                getattr(p, name).data = whole[at:at + n]
                at += n
        if not plain:
            fused.process_weights_after_loading(device)
        return fused._matmul  # a bound method: the fused layer is not a submodule (its weights are counted once)

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [h, nope, r] and W_UV [h, v, r]: views of kv_b_proj's weight."""
        w = self._kv_b_dense.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def _kv_b_packed(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """W_UK's per-head transpose and W_UV packed for the CPU's AVX-512 BF16 products (cpu_skinny_gemm.
        pack_groups), made on the first decode and again when kv_b_proj's weight is rewritten; (None, None) where
        they do not run (a GPU, float32, a build without AVX-512 BF16)."""
        dense = self._kv_b_dense
        if torch.compiler.is_compiling() or not dense.is_cpu or dense.dtype is not torch.bfloat16:
            return None, None

        def make() -> tuple[torch.Tensor | None, torch.Tensor | None]:
            w_uk, w_uv = self._kv_b()
            return pack_groups(w_uk.transpose(1, 2)), pack_groups(w_uv)

        return derived(dense, "_moeserve_kv_b_packed", make)


def deepseek_gate(config: ModelConfig) -> TopKRouter:
    """The gate of the config's version (see the module doc): scoring, groups, bias, renormalization, scale."""
    return TopKRouter(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                      scoring_func=config.scoring_func, topk_method=config.topk_method, n_group=config.n_group,
                      topk_group=config.topk_group, renormalize=config.norm_topk_prob,
                      routed_scaling_factor=config.routed_scaling_factor,
                      correction_bias=config.topk_method == "noaux_tc")


class DeepseekV3ForCausalLM(CausalLM):
    @staticmethod
    def attention_class(config: ModelConfig) -> type[nn.Module]:
        return MLAttention

    make_gate = staticmethod(deepseek_gate)

    @staticmethod
    def rotary_dim(config: ModelConfig) -> int:
        return config.qk_rope_head_dim  # only the rope part of each head rotates


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """The same modules as V3; the config picks V2's softmax gate and YaRN."""
