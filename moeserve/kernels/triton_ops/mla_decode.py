"""Triton `mla_decode` (moeserve/kernels/mla_decode.py): split-KV flash decoding over the latent cache.

Stage 1, grid (B, head blocks, splits): a program loads its 16 heads' queries once ([16, r] and [16, rope]), then
walks its split of the request's slots BLOCK_N at a time: it gathers those cache rows, scores them with two tensor-
core dots (latent and rope parts), and folds them into a running max, sum and [16, r] accumulator (the value is the
same rows' latent part, so each row is read once for K and V). It writes the split's normalised output and
log-sum-exp. Stage 2, grid (B, heads): the splits' outputs weighted by exp(lse - max).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moeserve.kernels.triton_ops.direct_launch import DirectLauncher

BLOCK_H = 16  # query heads per program: tl.dot's smallest M
MAX_SPLITS = 128  # batch 1 at 4,096 tokens: 128 programs of 32 rows (64 left the H200 at 162 GB/s)
BLOCK_N = 32  # cache rows a loop step


@triton.jit
def _mla_decode_split_kernel(q_ptr, qr_ptr, cache_ptr, slots_ptr, seq_lens_ptr, o_ptr, lse_ptr, H, split_len, scale,
                  stride_qb, stride_qh, stride_qrb, stride_qrh, stride_c, stride_sb, stride_ob, stride_oh, stride_os,
                  stride_lb, stride_lh,
                  V_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    cv = tl.arange(0, BLOCK_V)
    cr = tl.arange(0, BLOCK_R)
    hm = heads < H
    vm = cv < V_DIM
    rm = cr < ROPE_DIM
    q_row = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q_v = tl.load(q_row + cv[None, :], mask=hm[:, None] & vm[None, :], other=0.0)  # [BLOCK_H, BLOCK_V]
    qr_row = qr_ptr + b.to(tl.int64) * stride_qrb + heads[:, None] * stride_qrh  # the rope part: its own tensor
    q_r = tl.load(qr_row + cr[None, :], mask=hm[:, None] & rm[None, :], other=0.0)  # [BLOCK_H, BLOCK_R]
    if UPCAST:  # Triton's interpreter gets bf16 dots wrong (3.9): the CPU tests multiply in fp32
        q_v = q_v.to(tl.float32)
        q_r = q_r.to(tl.float32)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    slot_row = slots_ptr + b.to(tl.int64) * stride_sb
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        nm = offs < end
        slot = tl.load(slot_row + offs, mask=nm, other=0).to(tl.int64)
        row = cache_ptr + slot[:, None] * stride_c
        k_v = tl.load(row + cv[None, :], mask=nm[:, None] & vm[None, :], other=0.0)  # [BLOCK_N, BLOCK_V]
        k_r = tl.load(row + V_DIM + cr[None, :], mask=nm[:, None] & rm[None, :], other=0.0)
        if UPCAST:
            k_v = k_v.to(tl.float32)
            k_r = k_r.to(tl.float32)
        qk = (tl.dot(q_v, tl.trans(k_v), input_precision=PRECISION)
              + tl.dot(q_r, tl.trans(k_r), input_precision=PRECISION))  # [BLOCK_H, BLOCK_N] fp32
        qk = tl.where(nm[None, :], qk * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(qk - m_new[:, None])
        s = s * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_v.dtype), k_v, input_precision=PRECISION)
        m = m_new
    has = s > 0
    out = acc / tl.where(has, s, 1.0)[:, None]
    lse = tl.where(has, m + tl.log(tl.where(has, s, 1.0)), float("-inf"))
    o_row = o_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + split * stride_os
    tl.store(o_row + cv[None, :], out, mask=hm[:, None] & vm[None, :])
    tl.store(lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=hm)


@triton.jit
def _mla_decode_combine_kernel(o_ptr, lse_ptr, out_ptr, num_splits, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                    stride_outb, stride_outh, V_DIM: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cs = tl.arange(0, BLOCK_S)
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + cs, mask=cs < num_splits, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.where(lse > float("-inf"), tl.exp(lse - tl.where(top > float("-inf"), top, 0.0)), 0.0)
    total = tl.sum(w, 0)
    cv = tl.arange(0, BLOCK_V)
    vm = cv < V_DIM
    acc = tl.zeros([BLOCK_V], tl.float32)
    for sp in range(0, num_splits):
        ws = tl.sum(tl.where(cs == sp, w, 0.0), 0)
        part = tl.load(o_ptr + b * stride_ob + h * stride_oh + sp * stride_os + cv, mask=vm, other=0.0)
        acc += ws * part
    acc = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_outb + h * stride_outh + cv, acc.to(out_ptr.dtype.element_ty), mask=vm)


_SPLIT = DirectLauncher(_mla_decode_split_kernel)
_COMBINE = DirectLauncher(_mla_decode_combine_kernel)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, so that the tests cover the combine
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_splits(batch: int, heads: int, length: int, block_n: int, num_sms: int) -> tuple[int, int]:
    """(splits, rows per split, a multiple of block_n): enough programs for two waves over the SMs, at least one
    block of rows per split."""
    programs = batch * triton.cdiv(heads, BLOCK_H)
    splits = max(1, min(triton.cdiv(2 * num_sms, max(programs, 1)), triton.cdiv(length, block_n), MAX_SPLITS))
    split_len = triton.cdiv(triton.cdiv(length, splits), block_n) * block_n
    return triton.cdiv(length, split_len) if length else 1, max(split_len, block_n)


def mla_decode(q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor, v_dim: int,
               scale: float, q_rope: torch.Tensor | None = None) -> torch.Tensor:
    """Same signature as moeserve.kernels.mla_decode.mla_decode_reference."""
    if q_rope is None:
        q, q_rope = q[..., :v_dim], q[..., v_dim:]
    B, H = q.shape[:2]
    D = v_dim + q_rope.shape[-1]
    L = slots.shape[1]
    if (cache.dim() != 2 or cache.shape[1] != D or q.shape[-1] != v_dim or not 0 < v_dim < D or slots.shape[0] != B
            or q_rope.shape[:2] != (B, H)):
        raise ValueError(f"mla_decode: q {tuple(q.shape)}, q_rope {tuple(q_rope.shape)}, cache {tuple(cache.shape)}, "
                         f"slots {tuple(slots.shape)} and v_dim {v_dim} do not fit")
    q = q if q.stride(-1) == 1 else q.contiguous()
    q_rope = q_rope if q_rope.stride(-1) == 1 else q_rope.contiguous()
    slots = slots if slots.stride(-1) == 1 else slots.contiguous()
    assert cache.stride(-1) == 1
    out = q.new_empty(B, H, v_dim)
    if B == 0:
        return out
    splits, split_len = plan_splits(B, H, L, BLOCK_N, _num_sms(q.device))
    part = torch.empty(B, H, splits, v_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
    # tl.dot needs K >= 16: a narrower part (tiny test models' rope of 8) is padded with masked zeros
    bv, br = max(16, triton.next_power_of_2(v_dim)), max(16, triton.next_power_of_2(D - v_dim))
    _SPLIT((B, triton.cdiv(H, BLOCK_H), splits), q, q_rope, cache, slots, seq_lens, part, lse, H, split_len,
           float(scale), q.stride(0), q.stride(1), q_rope.stride(0), q_rope.stride(1), cache.stride(0),
           slots.stride(0), part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
           V_DIM=v_dim, ROPE_DIM=D - v_dim, BLOCK_V=bv, BLOCK_R=br,
           BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
           UPCAST=not q.is_cuda and q.dtype != torch.float32,  # only under TRITON_INTERPRET (CPU tensors)
           num_warps=4, num_stages=3)
    _COMBINE((B, H), part, lse, out, splits, part.stride(0), part.stride(1), part.stride(2), lse.stride(0),
             lse.stride(1), out.stride(0), out.stride(1), V_DIM=v_dim, BLOCK_V=bv,
             BLOCK_S=triton.next_power_of_2(splits), num_warps=4)
    return out
