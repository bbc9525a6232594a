"""Triton `mla_rope_cache` (moeserve/kernels/mla_rope_cache.py): program (t, b) rotates token t's query rope part
for one block of heads into a new dense tensor; the first block's program also normalises the token's latent,
rotates its key's rope part and writes both into the token's cache row.

Floating-point contraction is off for this kernel (enable_fp_fusion=False): torch computes x * cos + partner * sin
as two rounded products and a rounded sum, and an FMA would round once fewer, so the rotations would drift from
the reference by an ulp in float32 and, after the rounding to bf16, by an ulp of bf16 now and then.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.triton_ops.direct_launch import DirectLauncher


@triton.jit
def _rotate(x_ptrs, partner_ptrs, cos, sin, mask):
    """x * cos + partner * sin in float32 (the caller rounds it to the activations' dtype)."""
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(partner_ptrs, mask=mask, other=0.0).to(tl.float32)
    return x * cos + partner * sin


@triton.jit
def _mla_rope_cache_kernel(q_ptr, ckv_ptr, krope_ptr, w_ptr, rope_ptr, loc_ptr, cache_ptr, qo_ptr,
                           H, R_LORA, ROPE_DIM, eps,
                           stride_qt, stride_qh, stride_ckv, stride_krope, stride_rope_t, stride_rope_c,
                           stride_cache, stride_qot, stride_qoh,
                           INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_H: tl.constexpr):
    """Program (t, b): token t's query heads [b * BLOCK_H, (b + 1) * BLOCK_H); block 0 also writes its cache row."""
    t = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    act = ckv_ptr.dtype.element_ty  # the activations' dtype: what the unfused ops round to

    # the rotation of this token: cos and signed sin per rope column, and each column's partner in its pair
    d = tl.arange(0, BLOCK_D)
    d_ok = d < ROPE_DIM
    if INTERLEAVED:
        partner = d ^ 1
    else:
        half = ROPE_DIM // 2
        partner = tl.where(d < half, d + half, d - half)
    cos = tl.load(rope_ptr + t * stride_rope_t + d, mask=d_ok, other=0.0)
    sin = tl.load(rope_ptr + t * stride_rope_t + stride_rope_c + d, mask=d_ok, other=0.0)

    h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    ok2 = (h < H)[:, None] & d_ok[None, :]
    q_base = q_ptr + t * stride_qt + h[:, None].to(tl.int64) * stride_qh
    q = _rotate(q_base + d[None, :], q_base + partner[None, :], cos[None, :], sin[None, :], ok2)
    tl.store(qo_ptr + t * stride_qot + h[:, None].to(tl.int64) * stride_qoh + d[None, :],
             q.to(qo_ptr.dtype.element_ty), mask=ok2)

    if head_block == 0:
        row = tl.load(loc_ptr + t).to(tl.int64) * stride_cache
        # the latent: RMSNorm with rms_norm's rounding (x / rms to the activations' dtype, then times the weight)
        cols = tl.arange(0, BLOCK_R)
        ok = cols < R_LORA
        xf = tl.load(ckv_ptr + t * stride_ckv + cols, mask=ok, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / R_LORA + eps)
        normed = (xf * rstd).to(act).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(cache_ptr + row + cols, (normed * w).to(act).to(cache_ptr.dtype.element_ty), mask=ok)

        k_base = krope_ptr + t * stride_krope
        k = _rotate(k_base + d, k_base + partner, cos, sin, d_ok)
        tl.store(cache_ptr + row + R_LORA + d, k.to(act).to(cache_ptr.dtype.element_ty), mask=d_ok)


_MLA_ROPE_CACHE = DirectLauncher(_mla_rope_cache_kernel)


def _dense_rows(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dimension is dense (the views the model passes), else a dense copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def mla_rope_cache(q_rope: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor, norm_weight: torch.Tensor,
                   eps: float, rope: torch.Tensor, interleaved: bool, cache: torch.Tensor,
                   loc: torch.Tensor) -> torch.Tensor:
    """Same signature as moeserve.kernels.mla_rope_cache.mla_rope_cache_reference; returns q_rope rotated as a
    new dense [T, h, R] tensor in q_rope's dtype (q itself is left as it was)."""
    T, H, R = q_rope.shape
    r = c_kv.shape[-1]
    assert c_kv.shape == (T, r) and k_rope.shape == (T, R) and rope.shape == (T, 2, R), (
        q_rope.shape, c_kv.shape, k_rope.shape, rope.shape)
    assert cache.shape[-1] == r + R and loc.shape == (T,) and norm_weight.shape == (r,), (cache.shape, loc.shape)
    assert R % 2 == 0 and cache.stride(-1) == 1, (R, cache.stride())
    q_rope, c_kv, k_rope, rope = (_dense_rows(x) for x in (q_rope, c_kv, k_rope, rope))
    q_out = torch.empty((T, H, R), dtype=q_rope.dtype, device=q_rope.device)
    if T == 0:
        return q_out
    block_d = triton.next_power_of_2(R)
    # ~1k query elements a program; V3's 128 heads spread over 8 programs a token, so a decode step stays short
    block_h = max(1, min(triton.next_power_of_2(H), 1024 // block_d))
    _MLA_ROPE_CACHE((T, triton.cdiv(H, block_h)), q_rope, c_kv, k_rope, norm_weight, rope, loc, cache, q_out,
                    H, r, R, eps,
                    q_rope.stride(0), q_rope.stride(1), c_kv.stride(0), k_rope.stride(0), rope.stride(0),
                    rope.stride(1), cache.stride(0), q_out.stride(0), q_out.stride(1),
                    INTERLEAVED=bool(interleaved), BLOCK_R=triton.next_power_of_2(r), BLOCK_D=block_d,
                    BLOCK_H=block_h, num_warps=4, enable_fp_fusion=False)
    return q_out
