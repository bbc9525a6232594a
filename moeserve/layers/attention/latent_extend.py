"""MLA's extend in the absorbed form: new query rows attend over the latent cache itself, as a decode does.

The expanded extend (models/deepseek.py) reads every request's whole sequence back from the cache and expands
each latent through kv_b_proj into per-head k_nope and v, every layer and every step. Over a long cached prefix
and a short new tail (a multi-turn conversation's next turn) that expansion grows with the prefix. The absorbed
form skips it: q_nope moves into the latent space (q_nope W_UK), all heads attend over one latent head
([c_kv | k_rope] as key, c_kv as value), and the output comes back through W_UV. The same logits, another cost.

Cost in multiply-adds per layer, for a step of T new tokens, S = sum(seq_lens) cached + new slots and
P (query, key) pairs (`query_key_pairs`), h heads, latent r, rope R, nope and v head widths:

    expanded = S * r * h * (nope + v)  +  P * h * (nope + R + v + c)
    absorbed = P * h * (2 * r + R + c) +  T * h * r * (nope + v)       (scores over r + R, values over r)

where c (SCORE_COST) is what a score's softmax and mask cost beside its products, in multiply-adds: the same in both
forms, it weighs most where the heads are narrow (the default model's).

The absorbed attention is wider (2r + R against nope + R + v), so it pays when the prefix is long beside the new
rows: for DeepSeek-V3's shapes (r 512, R 64, nope 128, v 128) at L >> T below about T = 170 new tokens. On the
CPU the two forms do not run their multiply-adds at the same rate (CPU_ABSORBED_RATE, by the model's dtype):
benchmark/experiments/bench_latent_extend.py measured the crossover (docs/serving.md).

`absorbed_extend` is the layer's whole attention. Its attention proper runs in the C++ kernel on the CPU
(kernels/cpu_latent_extend.py: the rows read through kv_indices, each block of query rows' scores kept in cache,
the causal far side skipped row by row); under torch.compile, or where the kernel cannot build,
`latent_extend_attention` runs ExtendPlan's padded groups in torch, every query row's heads folded into the rows
of one matmul against the single latent head (no copy of K or V per head), the group's causal mask broadcast over
the heads. The CUDA path keeps the expanded form (its Triton extend kernel): the absorbed extend is not run
there (`absorbed_requests` says no for any step off the CPU).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from moeserve.kernels import cpu_latent_extend, cpu_skinny_gemm
from moeserve.kernels.skinny_gemm import batched_skinny_gemm
from moeserve.layers.attention.extend_plan import ExtendGroup, ExtendPlan
from moeserve.layers.attention.latent_decode import latent_to_heads

# The absorbed form's multiply-adds per second over the expanded form's, on the CPU: the time rule weighs each form's
# multiply-adds by it. The absorbed form's attention multiplies in float32 (see absorbed_extend); the expanded one runs kv_b_proj
# and SDPA in the model's dtype, and torch's bf16 GEMMs ran several times slower than float32 ones on the CPUs
# measured. bench_latent_extend.py (docs/serving.md, the log of 2026-12-06): in float32 0.9-1.6 on a quiet VM (the
# default model's narrow widths pay more fixed costs in the expanded form), in bf16 3 and more.
CPU_ABSORBED_RATE = {torch.float32: 1.5}
CPU_ABSORBED_RATE_16BIT = 2.0  # bf16 and fp16 models
# A (query, key, head) score's softmax and mask in multiply-adds of the products: the absorbed extend of 1,024 fresh
# tokens on the default model (before a6eb984 skipped the causal triangle) spent 29 ps a multiply-add in bmm,
# 1.5 ns a score in softmax and 1.2 ns in the mask's add (torch profiler, one thread, AMD EPYC Zen 4, 2026-12-07).
SCORE_COST = 96
SCORE_BYTES = 64 << 20  # the float32 scores one block of query rows may hold (`_group_attention`)
QUERY_BLOCK = 128  # query rows of one block at most (`_group_attention`: the causal triangle is skipped per block)


@dataclass(frozen=True)
class MLAShape:
    """One rank's MLA widths: heads, latent rank, rope, nope and v head dims."""

    heads: int
    kv_lora: int
    rope: int
    nope: int
    v: int

    def expanded_cost(self, num_kv: int, pairs: int) -> int:
        """Multiply-adds of the expanded extend (module doc)."""
        return num_kv * self.kv_lora * self.heads * (self.nope + self.v) + pairs * self.heads * (
            self.nope + self.rope + self.v + SCORE_COST)

    def absorbed_cost(self, num_tokens: int, pairs: int) -> int:
        """Multiply-adds of the absorbed extend (module doc)."""
        scores = pairs * self.heads * (2 * self.kv_lora + self.rope + SCORE_COST)
        return scores + num_tokens * self.heads * self.kv_lora * (self.nope + self.v)


def query_key_pairs(extend_lens: list[int], seq_lens: list[int]) -> int:
    """(query, key) pairs a causal extend computes: request b's n new rows see s - n + 1 .. s keys."""
    return sum(n * s - n * (n - 1) // 2 for n, s in zip(extend_lens, seq_lens, strict=True))


def absorbed_requests(shape: MLAShape, plan: ExtendPlan, extend_lens: list[int], seq_lens: list[int],
                      queries: torch.Tensor) -> list[bool]:
    """Per request of a CPU extend step (queries: any of its query tensors, whose device and dtype decide): run its
    rows absorbed, where its own multiply-adds, weighed by each form's rate for the dtype, take less time absorbed.
    A request's form depends on its own lengths alone, so its rounding never depends on the requests batched
    beside it. Never on another device: the absorbed extend has run on the CPU only, and CUDA keeps its Triton
    expanded path unchanged."""
    if not queries.is_cpu or plan.seqs_host is not None or not plan.groups:
        return [False] * len(extend_lens)
    rate = CPU_ABSORBED_RATE.get(queries.dtype, CPU_ABSORBED_RATE_16BIT)
    out = []
    for n, s in zip(extend_lens, seq_lens, strict=True):
        pairs = query_key_pairs([n], [s])
        out.append(shape.absorbed_cost(n, pairs) < rate * shape.expanded_cost(s, pairs))
    return out


def absorbed_extend(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, kv_indices: torch.Tensor,
                    kv_indptr: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, plan: ExtendPlan,
                    extend_lens: list[int], scale: float,
                    packed: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)) -> torch.Tensor:
    """The absorbed extend of one layer: q_nope [T, h, nope] and q_rope [T, h, R] (roped), request b's rows its new
    tokens (extend_lens[b] of them); cache [N, r + R] the latent rows [c_kv | k_rope], request b's whole sequence at
    kv_indices[kv_indptr[b]:kv_indptr[b + 1]]; W_UK [h, nope, r] and W_UV [h, v, r] -> [T, h, v] in q_nope's dtype,
    what the expanded extend computes. The attention runs in the CPU kernel (kernels/cpu_latent_extend.py) where it
    takes the step, else in torch over the gathered rows (`latent_extend_attention`), in float32 either way.
    The products through W_UK and W_UV: in a bf16 model with `packed` (the decode's packed per-head copies of W_UK^T
    and W_UV, MLAttention._kv_b_packed) and few enough rows for them, the decode's bf16 products and roundings (q in
    the latent space and the attention's output rounded to bf16); else in float32.
    NOTE: torch's bf16 bmm ran 10-20x slower than converting and multiplying in float32 on the CPUs measured (one
    without AVX-512 BF16), and a weight's conversion costs less than its use; at a few dozen rows the conversion
    was most of the absorbed form's time in bf16 (V2-Lite's widths), which the packed products skip."""
    uk_packed, uv_packed = packed
    heads_first = q_nope.transpose(0, 1)  # [h, T, nope]
    bf16_products = cpu_skinny_gemm.batched_packed_takes(heads_first, uk_packed)
    if bf16_products:
        q_latent = batched_skinny_gemm(heads_first, w_uk.transpose(1, 2), packed=uk_packed).transpose(0, 1).float()
    else:
        q_latent = torch.bmm(heads_first.float(), w_uk.float()).transpose(0, 1)  # [T, h, r]
    q = torch.cat((q_latent, q_rope.float()), dim=-1)
    if cpu_latent_extend.takes(q, cache):
        q_indptr = torch.tensor([0, *itertools.accumulate(extend_lens)], dtype=torch.int64)
        o = cpu_latent_extend.latent_extend(q, cache, kv_indices, kv_indptr, q_indptr, w_uk.shape[-1], scale)
    else:
        o = latent_extend_attention(q, cache[kv_indices], w_uk.shape[-1], plan, scale)  # [T, h, r] float32
    if bf16_products and uv_packed is not None:
        return latent_to_heads(o.to(q_nope.dtype), w_uv, uv_packed)
    return torch.bmm(o.transpose(0, 1), w_uv.float().transpose(1, 2)).transpose(0, 1).to(q_nope.dtype)


def latent_extend_attention(q: torch.Tensor, kv: torch.Tensor, v_dim: int, plan: ExtendPlan,
                            scale: float) -> torch.Tensor:
    """q [T, h, r + R] ([q_nope W_UK | q_rope], request b's rows its new tokens); kv [S, r + R] latent rows;
    v_dim = r -> [T, h, r] in q's dtype, each row's softmax(scale * q · kv^T) · kv[:, :r] over its causal
    prefix. plan: the step's padded groups."""
    T, h, _ = q.shape
    groups = plan.groups
    if len(groups) == 1 and groups[0].q_rows == (0, T):
        return _group_attention(q, kv, v_dim, groups[0], scale)
    out = q.new_empty(T, h, v_dim)
    for g in groups:
        o = _group_attention(q, kv, v_dim, g, scale)  # [B * lq, h, r]
        if g.q_rows is not None:
            out[g.q_rows[0]:g.q_rows[1]] = o
        else:
            out.index_copy_(0, g.out_dst, o.index_select(0, g.out_src))
    return out


def _group_attention(q: torch.Tensor, kv: torch.Tensor, v_dim: int, g: ExtendGroup, scale: float) -> torch.Tensor:
    """One padded group -> [B * lq, h, r] (padded rows included). Rows (t, head) of q are consecutive, so the
    group's queries are a [B, lq * h, D] view: one matmul per request against its [lk, D] latent rows. The float32
    scores [B, rows * h, lk] are materialized, so the query rows go in blocks (at most QUERY_BLOCK rows, and at most
    SCORE_BYTES of scores); a block reads the keys up to the last one any of its rows sees (the causal triangle's
    far side is skipped, not computed and masked: half the products of a prompt without a cached prefix)."""
    if g.q_rows is not None:
        qb, kb = q[g.q_rows[0]:g.q_rows[1]], kv[g.kv_rows[0]:g.kv_rows[1]]
    else:
        qb, kb = q.index_select(0, g.q_index), kv.index_select(0, g.kv_index)
    B, h, D = g.batch, q.shape[1], q.shape[2]
    qb = qb.reshape(B, g.lq, h, D).float()  # (float32 products: see absorbed_extend)
    kb = kb.reshape(B, g.lk, D).float()
    bias = g.bias()  # [B or 1, lq, lk]
    out = q.new_empty(B, g.lq, h, v_dim)
    step = max(1, min(QUERY_BLOCK, SCORE_BYTES // (4 * B * h * g.lk)))
    last = g.last_keys()  # (host ints: this path runs on the CPU only)
    for t0 in range(0, g.lq, step):
        t1 = min(t0 + step, g.lq)
        lk = min(g.lk, max(last[t0:t1]) + 1)
        scores = torch.bmm(qb[:, t0:t1].reshape(B, (t1 - t0) * h, D), kb[:, :lk].transpose(1, 2))
        scores = torch.add(bias[:, t0:t1, None, :lk], scores.view(B, t1 - t0, h, lk), alpha=scale)
        probs = scores.softmax(dim=-1).view(B, (t1 - t0) * h, lk)
        out[:, t0:t1] = torch.bmm(probs, kb[:, :lk, :v_dim]).view(B, t1 - t0, h, v_dim)
    return out.view(B * g.lq, h, v_dim)
