"""MLA's extend in the absorbed form: new query rows attend over the latent cache itself, as a decode does.

The expanded extend (models/deepseek.py) reads every request's whole sequence back from the cache and expands
each latent through kv_b_proj into per-head k_nope and v, every layer and every step. Over a long cached prefix
and a short new tail (a multi-turn conversation's next turn) that expansion grows with the prefix. The absorbed
form skips it: q_nope moves into the latent space (q_nope W_UK), all heads attend over one latent head
([c_kv | k_rope] as key, c_kv as value), and the output comes back through W_UV. The same logits, another cost.

The work of each form per layer, for a step of T new tokens, S = sum(seq_lens) cached + new slots and
P (query, key) pairs (`query_key_pairs`), h heads, latent r, rope R, nope and v head widths, in multiply-adds:

    expanded: products S * r * h * (nope + v)    (kv_b_proj over the whole sequence)
              attention P * h * (nope + R + v)
    absorbed: products T * h * r * (nope + v)    (q_nope W_UK, and back through W_UV)
              attention P * h * (2 * r + R)      (scores over r + R, values over r)

and in both P * h scores (a mask and a softmax each), the absorbed kernel's packed copy of the S latent rows, and a
call's fixed cost. The absorbed attention is wider, so it pays when the prefix is long beside the new rows. Each
form's time is its work weighed by nanoseconds per unit (`FormCost`) that bench_latent_extend.py measures and fits
(`--fit`) on the CPU, by dtype: the two forms do not run their multiply-adds at the same rate (the absorbed
attention multiplies in float32 in the C++ kernel, the expanded one runs kv_b_proj and the attention in torch in
the model's dtype), and torch's bf16 GEMMs run at their rate only on a CPU with bf16 dot products (AVX-512 BF16
or AMX): elsewhere several times slower (`NO_NATIVE_BF16`). The rule picks the form of fewer nanoseconds per
request (`absorbed_requests`); docs/serving.md has the measured table and the picks.

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
from dataclasses import dataclass, replace

import torch

from moeserve.kernels import cpu_isa, cpu_latent_extend, cpu_skinny_gemm
from moeserve.kernels.skinny_gemm import batched_skinny_gemm
from moeserve.layers.attention.extend_plan import ExtendGroup, ExtendPlan
from moeserve.layers.attention.latent_decode import latent_to_heads


@dataclass(frozen=True)
class FormCost:
    """Nanoseconds one form of the extend takes on one CPU thread, per unit of its work (module doc): `products`
    per multiply-add of its dense products, `attention` per multiply-add of its attention, `score` per score's mask
    and softmax, `rows` per element of the latent rows it packs (the absorbed kernel's copy), `call` per call."""

    products: float
    attention: float
    score: float
    rows: float
    call: float

    def ns(self, products: int, attention: int, scores: int, rows: int) -> float:
        return (self.products * products + self.attention * attention + self.score * scores + self.rows * rows
                + self.call)


# (expanded, absorbed) by the model's dtype: least squares (relative error) on the times of two runs of
# `bench_latent_extend.py --shapes default,v2lite --dtype D` (one thread, 24 shapes each: the default model's widths
# and V2-Lite's, 16-1,024 new tokens over 0-2,048 cached; AMD EPYC Zen 4 with AVX-512 BF16, 2026-12-08). The picks
# agree with the faster measured form at every shape but V2-Lite's 1,024 fresh tokens (expanded, 6-9% slower than
# absorbed: the expanded attention's cost grows faster than its multiply-adds there) and ties within 20%.
CPU_FORM_COSTS = {
    torch.float32: (FormCost(products=0.027, attention=0.043, score=4.4, rows=0.0, call=190e3),
                    FormCost(products=0.034, attention=0.019, score=0.75, rows=0.63, call=100e3)),
    torch.bfloat16: (FormCost(products=0.011, attention=0.049, score=3.1, rows=0.0, call=220e3),
                     FormCost(products=0.016, attention=0.021, score=0.50, rows=0.13, call=120e3)),
}
# Without bf16 dot products (no AVX-512 BF16 or AMX) torch's 16-bit GEMMs run slower: the same benchmark with
# oneDNN held to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2, the same VM) ran V2-Lite's expanded kv_b_proj 4.1x and its attention
# 2.8x slower per multiply-add; the absorbed form's products run in float32 there (its float32 costs).
NO_NATIVE_BF16 = 4.0


def cpu_form_costs(dtype: torch.dtype) -> tuple[FormCost, FormCost]:
    """(expanded, absorbed) costs of a model in `dtype` on this CPU (float16 as bf16)."""
    if dtype == torch.float32:
        return CPU_FORM_COSTS[torch.float32]
    expanded, absorbed = CPU_FORM_COSTS[torch.bfloat16]
    if cpu_isa.native_bf16():
        return expanded, absorbed
    slow = replace(expanded, products=expanded.products * NO_NATIVE_BF16,
                   attention=expanded.attention * NO_NATIVE_BF16)
    return slow, CPU_FORM_COSTS[torch.float32][1]


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

    def expanded_work(self, num_kv: int, pairs: int) -> tuple[int, int, int, int]:
        """(products, attention multiply-adds, scores, packed row elements) of the expanded extend (module doc)."""
        h = self.heads
        return (num_kv * self.kv_lora * h * (self.nope + self.v), pairs * h * (self.nope + self.rope + self.v),
                pairs * h, 0)

    def absorbed_work(self, num_tokens: int, num_kv: int, pairs: int) -> tuple[int, int, int, int]:
        """(products, attention multiply-adds, scores, packed row elements) of the absorbed extend (module doc)."""
        h = self.heads
        return (num_tokens * h * self.kv_lora * (self.nope + self.v), pairs * h * (2 * self.kv_lora + self.rope),
                pairs * h, num_kv * (2 * self.kv_lora + self.rope))


def query_key_pairs(extend_lens: list[int], seq_lens: list[int]) -> int:
    """(query, key) pairs a causal extend computes: request b's n new rows see s - n + 1 .. s keys."""
    return sum(n * s - n * (n - 1) // 2 for n, s in zip(extend_lens, seq_lens, strict=True))


def absorbed_requests(shape: MLAShape, plan: ExtendPlan, extend_lens: list[int], seq_lens: list[int],
                      queries: torch.Tensor) -> list[bool]:
    """Per request of a CPU extend step (queries: any of its query tensors, whose device and dtype decide): run its
    rows absorbed, where its own work takes fewer nanoseconds absorbed (`cpu_form_costs`). A request's form depends
    on its own lengths alone, so its rounding never depends on the requests batched beside it. Never on another
    device: the absorbed extend has run on the CPU only, and CUDA keeps its Triton expanded path unchanged."""
    if not queries.is_cpu or plan.seqs_host is not None or not plan.groups:
        return [False] * len(extend_lens)
    expanded, absorbed = cpu_form_costs(queries.dtype)
    out = []
    for n, s in zip(extend_lens, seq_lens, strict=True):
        pairs = query_key_pairs([n], [s])
        out.append(absorbed.ns(*shape.absorbed_work(n, s, pairs)) < expanded.ns(*shape.expanded_work(s, pairs)))
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
