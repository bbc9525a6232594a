"""Reference attention over the paged KV cache, correct for ragged batches (torch SDPA inside).

- `extend_attention`: new queries of each request attend causally over the request's whole sequence
  (cached prefix + new tokens), batched over requests: on CUDA one Triton launch over the packed requests
  (kernels/extend_attention.py), elsewhere one SDPA call per group of similar lengths (extend_plan.py); the step's
  plan is built once in `AttentionMetadata`.
- `decode_attention`: one query per request over its cached tokens. The cache rows are gathered into a padded
  [B, max_len] block and masked, so a step is a few batched kernels with no per-request Python loop.

`AttentionMetadata` is built once per forward from the ForwardBatch and shared by all layers. A MIXED step
(--enable-mixed-chunk: a prefill chunk and the running decodes in one batch) holds two parts, the extend requests'
and the decodes'; a layer writes every token's KV once, then runs each part its own way (`attend_parts`), so a
decode row is computed as in a DECODE step (the absorbed MLA form, no expansion of its whole cached sequence).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moeserve.core.forward_batch import ForwardBatch, ForwardMode
from moeserve.kernels import extend_attention as extend_kernel
from moeserve.kernels.triton_available import use_triton
from moeserve.kvcache.kv_pool import KVPool
from moeserve.layers.attention.extend_plan import ExtendGroup, ExtendPlan

_CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # see _sdpa


class PieceSplitter(Protocol):
    """What a piecewise CUDA-graph capture (moeserve/rank/piecewise_graph_runner.py) puts into the metadata: every
    layer's attention runs through `split`, which ends the graph piece before it and begins the one after it."""

    def split(self, meta: AttentionMetadata, attend: Callable[..., torch.Tensor],
              rows: tuple[torch.Tensor, ...]) -> torch.Tensor: ...


@dataclass
class AttentionMetadata:
    """What every attention layer of one step needs, derived once from the batch."""

    mode: ForwardMode
    kv_pool: KVPool | None
    out_cache_loc: torch.Tensor  # [T] slots written this step
    kv_indices: torch.Tensor  # [sum(seq_lens)] slots of every request's whole sequence
    kv_indptr: torch.Tensor  # [B + 1] request b's slots are kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
    rope: torch.Tensor | None  # [T, 2, rotary_dim] float32: each token's cos and signed sin (RotaryEmbedding.forward)
    extend_lens: list[int]  # host
    seq_lens: list[int]  # host
    decode_slots: torch.Tensor | None = None  # [B, max_len] int64 cache slots (0 = scratch where masked)
    decode_bias: torch.Tensor | None = None  # [B, max_len] float32: 0 for a real token, -inf past seq_len
    decode_seq_lens: torch.Tensor | None = None  # [B] int64 on the device: the kernels that read decode_slots
    extend_plan: ExtendPlan | None = None  # extend steps: the padded groups every layer's attention runs
    # MIXED: the metadata of the extend requests (its rows first) and of the decodes (the rows after); None where
    # the part has no request (a two-batch-overlap micro-batch may hold only one of them)
    extend_part: AttentionMetadata | None = None
    decode_part: AttentionMetadata | None = None
    pieces: PieceSplitter | None = None  # set while a piecewise CUDA graph is captured (attend_parts says what for)
    memo: dict = field(default_factory=dict)  # what a layer derives from the step once for every layer

    @classmethod
    def build(cls, batch: ForwardBatch, rope: torch.Tensor | None) -> AttentionMetadata:
        """rope None: metadata for the attention proper only (what runs between piecewise graphs, whose rotary ran
        inside them)."""
        if batch.mode.is_mixed:
            return cls._build_mixed(batch, rope)
        # Decode reads no host lengths (torch.compile would guard on every one of them).
        extend = batch.mode.is_extend
        meta = cls(mode=batch.mode, kv_pool=batch.kv_pool, out_cache_loc=batch.out_cache_loc,
                   kv_indices=batch.kv_indices, kv_indptr=batch.kv_indptr, rope=rope, extend_lens=list(batch.extend_lens_cpu) if extend else [],
                   seq_lens=list(batch.seq_lens_cpu) if extend else [])
        if extend:
            meta.extend_plan = ExtendPlan.build(meta.extend_lens, meta.seq_lens, batch.out_cache_loc.device,
                                                kernel=use_triton(batch.out_cache_loc))
        if batch.mode.is_decode and batch.seq_lens.shape[0] > 0:
            meta.decode_seq_lens = batch.seq_lens
            if batch.decode_slots is not None:  # the scheduler's padded block (static shape under CUDA graphs)
                meta.decode_slots = batch.decode_slots
                meta.decode_bias = length_bias(batch.seq_lens, batch.decode_slots.shape[1])
            else:
                meta.decode_slots, meta.decode_bias = padded_kv_slots(batch.kv_indices, batch.kv_indptr,
                                                                      batch.seq_lens, max(batch.seq_lens_cpu))
        return meta

    @classmethod
    def _build_mixed(cls, batch: ForwardBatch, rope: torch.Tensor | None) -> AttentionMetadata:
        ext, dec = batch.mixed_parts()
        t = ext.num_tokens
        meta = cls(mode=batch.mode, kv_pool=batch.kv_pool, out_cache_loc=batch.out_cache_loc,
                   kv_indices=batch.kv_indices, kv_indptr=batch.kv_indptr, rope=rope, extend_lens=[], seq_lens=[])
        meta.extend_part = cls.build(ext, None if rope is None else rope[:t]) if ext.batch_size else None
        meta.decode_part = cls.build(dec, None if rope is None else rope[t:]) if dec.batch_size else None
        return meta

    @property
    def num_tokens(self) -> int:
        return int(self.out_cache_loc.shape[0])

    def select(self, requests: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
        """An EXTEND step's rows of some of its requests ([t] int64 on the step's device, in token order) and
        their own metadata: their slots, lengths and plan, as if they had been batched alone."""
        assert self.mode.is_extend and not self.mode.is_mixed and self.extend_plan is not None
        device = self.out_cache_loc.device
        q_start = [0]
        kv_start = [0]
        for n, s in zip(self.extend_lens, self.seq_lens, strict=True):
            q_start.append(q_start[-1] + n)
            kv_start.append(kv_start[-1] + s)
        rows = torch.cat([torch.arange(q_start[b], q_start[b + 1]) for b in requests]).to(device)
        kv_rows = torch.cat([torch.arange(kv_start[b], kv_start[b + 1]) for b in requests]).to(device)
        extend_lens = [self.extend_lens[b] for b in requests]
        seq_lens = [self.seq_lens[b] for b in requests]
        kv_indptr = torch.zeros(len(requests) + 1, dtype=torch.int64)
        kv_indptr[1:] = torch.cumsum(torch.tensor(seq_lens, dtype=torch.int64), 0)
        sub = AttentionMetadata(mode=self.mode, kv_pool=self.kv_pool, out_cache_loc=self.out_cache_loc[rows],
                                kv_indices=self.kv_indices[kv_rows], kv_indptr=kv_indptr.to(device),
                                rope=None if self.rope is None else self.rope[rows], extend_lens=extend_lens,
                                seq_lens=seq_lens)
        sub.extend_plan = ExtendPlan.build(extend_lens, seq_lens, device,
                                           kernel=self.extend_plan.seqs_host is not None)
        return rows, sub

    def parts(self) -> list[tuple[slice, AttentionMetadata]]:
        """(rows of this step's tokens, their metadata) per part: one EXTEND or DECODE part, or a MIXED step's two."""
        if not self.mode.is_mixed:
            return [(slice(0, self.num_tokens), self)]
        out = []
        t = self.extend_part.num_tokens if self.extend_part is not None else 0
        if self.extend_part is not None:
            out.append((slice(0, t), self.extend_part))
        if self.decode_part is not None:
            out.append((slice(t, self.num_tokens), self.decode_part))
        return out


def attend_parts(meta: AttentionMetadata, attend: Callable[..., torch.Tensor], *rows: torch.Tensor) -> torch.Tensor:
    """attend(*(x[part rows] for x in rows), part_meta) over the step's parts, concatenated in token order: a MIXED
    step runs its extend requests and its decodes apart (see the module doc); other steps call attend once.
    rows: per-token tensors [T, ...]; attend returns [rows of its part, ...].
    While a piecewise CUDA graph is captured (meta.pieces), the capture takes the call over: attention is what runs
    eagerly between the graph pieces, so every layer's projections, norms and MoE replay from graphs."""
    if meta.pieces is not None:
        return meta.pieces.split(meta, attend, rows)
    if not meta.mode.is_mixed:  # (reads no shape: torch.compile and CUDA graphs trace this path)
        return attend(*rows, meta)
    parts = meta.parts()
    if len(parts) == 1:
        return attend(*rows, parts[0][1])
    return torch.cat([attend(*(x[r] for x in rows), part) for r, part in parts])


def _past_end(seq_lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B, max_len] bool: True at positions >= the request's seq_len."""
    return torch.arange(max_len, device=seq_lens.device)[None, :] >= seq_lens[:, None]


def _as_bias(past: torch.Tensor) -> torch.Tensor:
    return torch.zeros(past.shape, device=past.device).masked_fill_(past, float("-inf"))


def length_bias(seq_lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B, max_len] float32 additive attention bias: 0 at positions < seq_len, -inf from there on."""
    return _as_bias(_past_end(seq_lens, max_len))


def padded_kv_slots(kv_indices: torch.Tensor, kv_indptr: torch.Tensor, seq_lens: torch.Tensor,
                    max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged kv_indices -> slots [B, max_len] (scratch slot 0 past each length) and their `length_bias`."""
    past = _past_end(seq_lens, max_len)
    pos = torch.arange(max_len, device=kv_indices.device)
    flat = (kv_indptr[:-1, None] + pos[None, :]).clamp_(max=max(kv_indices.shape[0] - 1, 0))
    return kv_indices[flat].masked_fill_(past, 0), _as_bias(past)


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extend_lens: list[int],
                     seq_lens: list[int], scale: float, sliding_window: int | None = None,
                     plan: ExtendPlan | None = None, q_rope: torch.Tensor | None = None,
                     k_rope: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each request's new queries over its whole sequence, batched over requests.

    q [T, Hq, D] (request b's rows are its extend_lens[b] new tokens, positions seq_len - extend_len ..
    seq_len - 1); k [S, Hkv, D] and v [S, Hkv, Dv], S = sum(seq_lens), request b's rows are its whole sequence.
    Returns [T, Hq, Dv]. Hq must be a multiple of Hkv (GQA/MQA). plan: the step's `ExtendPlan` for these lengths
    (AttentionMetadata builds it once for all layers); built here when not given. q_rope [T, Hq, R] and k_rope
    [S, R] (one per token, every head's) or [S, Hkv, R]: MLA's rope parts, scored beside q and k.
    A kernel plan runs the Triton kernel; otherwise one SDPA call per group of similar lengths (extend_plan.py),
    never one per request.
    """
    if plan is None:
        plan = ExtendPlan.build(extend_lens, seq_lens, q.device, kernel=use_triton(q))
    if plan.seqs_host is not None:
        return extend_kernel.extend_attention(q, k, v, plan.seqs, plan.max_extend, scale, q_rope, k_rope,
                                              sliding_window)
    if q_rope is not None:
        k_rope = k_rope if k_rope.dim() == 3 else k_rope[:, None, :].expand(-1, k.shape[1], -1)
        q, k = torch.cat((q, q_rope), dim=-1), torch.cat((k, k_rope), dim=-1)
    T, Hq, Dv = q.shape[0], q.shape[1], v.shape[-1]
    groups = plan.groups
    if len(groups) == 1 and groups[0].q_rows == (0, T):  # the whole step is one dense batch: no scatter
        return _group_attention(q, k, v, groups[0], scale, sliding_window).reshape(T, Hq, Dv)
    out = q.new_empty(T, Hq, Dv)
    for g in groups:
        o = _group_attention(q, k, v, g, scale, sliding_window)  # [B * lq, Hq, Dv]
        if g.q_rows is not None:
            out[g.q_rows[0]:g.q_rows[1]] = o
        else:
            out.index_copy_(0, g.out_dst, o.index_select(0, g.out_src))
    return out


def _group_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: ExtendGroup, scale: float,
                     sliding_window: int | None) -> torch.Tensor:
    """One padded group -> [B * lq, Hq, Dv] (padded rows included)."""
    if g.q_rows is not None:
        qb, kb, vb = q[g.q_rows[0]:g.q_rows[1]], k[g.kv_rows[0]:g.kv_rows[1]], v[g.kv_rows[0]:g.kv_rows[1]]
    else:
        qb, kb, vb = q.index_select(0, g.q_index), k.index_select(0, g.kv_index), v.index_select(0, g.kv_index)
    qb = qb.view(g.batch, g.lq, *q.shape[1:]).transpose(1, 2)  # [B, Hq, lq, D]
    kb = kb.view(g.batch, g.lk, *k.shape[1:]).transpose(1, 2)  # [B, Hkv, lk, D]
    vb = vb.view(g.batch, g.lk, *v.shape[1:]).transpose(1, 2)
    mask = g.mask(sliding_window)
    o = _sdpa(qb, kb, vb, mask, mask is None, scale)  # [B, Hq, lq, Dv]
    return o.transpose(1, 2).reshape(g.batch * g.lq, q.shape[1], v.shape[-1])


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | int, slots: torch.Tensor,
                     bias: torch.Tensor, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """One query per request over its cached tokens.

    q [B, Hq, D]; k_cache [num_slots, Hkv, D]; v_cache [num_slots, Hkv, Dv], or an int Dv: the value is the
    first Dv dims of the key (MLA's latent cache, gathered once); slots [B, L] and bias [B, L] from
    `padded_kv_slots`. Returns [B, Hq, Dv].
    The query heads sharing a KV head are the rows of one matmul, so K and V are never repeated per head
    (for MLA's absorbed form, all heads against one latent head). The rows are gathered with index_select
    (on CPU several times faster than advanced indexing) and the mask is an additive bias built once per step.
    """
    B, num_heads, D = q.shape
    L = slots.shape[1]
    num_kv_heads = k_cache.shape[1]
    rep = num_heads // num_kv_heads
    flat = slots.reshape(-1)
    k_rows = k_cache.index_select(0, flat).view(B, L, num_kv_heads, D).to(q.dtype)
    if isinstance(v_cache, int):
        v_rows = k_rows[..., :v_cache]
    else:
        v_rows = v_cache.index_select(0, flat).view(B, L, num_kv_heads, -1).to(q.dtype)
    if sliding_window is not None:
        seq_lens = (bias == 0).sum(-1, keepdim=True)
        pos = torch.arange(L, device=bias.device)[None, :]
        bias = bias.masked_fill(pos <= seq_lens - 1 - sliding_window, float("-inf"))
    scores = torch.matmul(q.view(B, num_kv_heads, rep, D), k_rows.permute(0, 2, 3, 1))  # [B, Hkv, rep, L]
    scores = torch.add(bias[:, None, None, :], scores.float(), alpha=scale)  # bias + scale * scores, in fp32
    probs = scores.softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, v_rows.transpose(1, 2)).view(B, num_heads, -1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
          scale: float) -> torch.Tensor:
    """SDPA on [B, H, L, D] with Hq a multiple of Hkv."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1 and not q.is_cuda:
        # NOTE: on CPU, enable_gqa is far slower than repeating K and V per query head (as transformers does).
        B, Hkv, L = k.shape[:3]
        k = k[:, :, None].expand(B, Hkv, rep, L, k.shape[-1]).reshape(B, Hkv * rep, L, k.shape[-1])
        v = v[:, :, None].expand(B, Hkv, rep, L, v.shape[-1]).reshape(B, Hkv * rep, L, v.shape[-1])
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    # NOTE: never cuDNN. torch picks it first on an H200 for MLA's q/k head 192 with v head 128 (FLASH refuses
    # unequal heads), and it builds an execution plan for every new shape: 59 ms of host time per new prompt length
    # (scripts/gpu/sdpa_backends.py at 3438fba), which made a serving prefill step 95 ms instead of 20.
    # EFFICIENT runs any length at once; MATH is the fallback for what neither fused kernel takes.
    with sdpa_kernel(_CUDA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=rep > 1)
