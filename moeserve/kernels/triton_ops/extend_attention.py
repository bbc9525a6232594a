"""Triton `extend_attention` (moeserve/kernels/extend_attention.py): causal flash attention over packed, ragged
requests, the query's and key's rope parts read apart.

Grid (query blocks, query heads, requests), the blocks of the longest request first (the last query block of a
request does the most work; starting those first evens out the tail). A program loads its BLOCK_M queries once
([BLOCK_M, D] and [BLOCK_M, R]), then walks the request's keys BLOCK_N at a time: two tensor-core dots for the
scores (main and rope parts), an online softmax in base 2 (the scale folded with log2(e)), one dot into the
[BLOCK_M, Dv] accumulator. Key blocks entirely below the causal diagonal (and inside the window) run without a
mask; the blocks the diagonal crosses run a second loop with it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.triton_ops.direct_launch import DirectLauncher

LOG2E = 1.4426950408889634


@triton.jit
def _attend_blocks(acc, m_i, l_i, q, q_r, k_ptr, kr_ptr, v_ptr, pos, lo, hi, window, scale_log2, stride_kt, stride_krt,
                   stride_vt, cd, cr, cv, D: tl.constexpr, R: tl.constexpr, DV: tl.constexpr,
                   BLOCK_N: tl.constexpr, HAS_ROPE: tl.constexpr, MASKED: tl.constexpr, WINDOW: tl.constexpr,
                   WIDE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Keys [lo, hi) of one request into the running (acc, m_i, l_i); lo a multiple of BLOCK_N."""
    for n0 in range(lo, hi, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        rows = offs
        if WIDE:  # 64-bit addresses: 128 heads x 256 columns pass 2^31 elements beyond 65k keys
            rows = offs.to(tl.int64)
        if MASKED:
            nm = offs < hi
            k = tl.load(k_ptr + rows[None, :] * stride_kt + cd[:, None], mask=nm[None, :] & (cd < D)[:, None],
                        other=0.0)  # [BLOCK_D, BLOCK_N]
        else:
            k = tl.load(k_ptr + rows[None, :] * stride_kt + cd[:, None], mask=(cd < D)[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, k, input_precision=PRECISION)
        if HAS_ROPE:
            if MASKED:
                kr = tl.load(kr_ptr + rows[None, :] * stride_krt + cr[:, None],
                             mask=nm[None, :] & (cr < R)[:, None], other=0.0)
            else:
                kr = tl.load(kr_ptr + rows[None, :] * stride_krt + cr[:, None], mask=(cr < R)[:, None], other=0.0)
            if UPCAST:
                kr = kr.to(tl.float32)
            qk += tl.dot(q_r, kr, input_precision=PRECISION)
        qk = qk * scale_log2  # base 2: exp2(x * scale * log2(e)) = exp(x * scale)
        if MASKED:
            seen = (offs[None, :] <= pos[:, None]) & nm[None, :]
            if WINDOW:
                seen &= offs[None, :] > pos[:, None] - window
            qk = tl.where(seen, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            vv = tl.load(v_ptr + rows[:, None] * stride_vt + cv[None, :], mask=nm[:, None] & (cv < DV)[None, :],
                         other=0.0)
        else:
            vv = tl.load(v_ptr + rows[:, None] * stride_vt + cv[None, :], mask=(cv < DV)[None, :], other=0.0)
        if UPCAST:
            vv = vv.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _extend_attention_kernel(q_ptr, qr_ptr, k_ptr, kr_ptr, v_ptr, o_ptr, seqs_ptr, scale_log2, window,
                             stride_qt, stride_qh, stride_qrt, stride_qrh, stride_kt, stride_kh, stride_krt,
                             stride_krh, stride_vt, stride_vh, stride_ot, stride_oh,
                             GROUP: tl.constexpr, D: tl.constexpr, R: tl.constexpr, DV: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ROPE: tl.constexpr,
                             WINDOW: tl.constexpr, WIDE: tl.constexpr, PRECISION: tl.constexpr,
                             UPCAST: tl.constexpr):
    mb = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q0 = tl.load(seqs_ptr + b * 4).to(tl.int64)
    n = tl.load(seqs_ptr + b * 4 + 1)
    k0 = tl.load(seqs_ptr + b * 4 + 2).to(tl.int64)
    s = tl.load(seqs_ptr + b * 4 + 3)
    if mb * BLOCK_M >= n:
        return
    prefix = s - n
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = offs_m < n
    pos = prefix + offs_m  # each query's position; padded rows sit past the last and are not stored
    cd = tl.arange(0, BLOCK_D)
    cr = tl.arange(0, BLOCK_R)
    cv = tl.arange(0, BLOCK_DV)
    kvh = h // GROUP
    q = tl.load(q_ptr + (q0 + offs_m)[:, None] * stride_qt + h * stride_qh + cd[None, :],
                mask=mm[:, None] & (cd < D)[None, :], other=0.0)
    q_r = q
    if HAS_ROPE:
        q_r = tl.load(qr_ptr + (q0 + offs_m)[:, None] * stride_qrt + h * stride_qrh + cr[None, :],
                      mask=mm[:, None] & (cr < R)[None, :], other=0.0)
    if UPCAST:  # Triton's interpreter gets bf16 dots wrong (3.9): the CPU tests multiply in fp32
        q = q.to(tl.float32)
        q_r = q_r.to(tl.float32)
    k_ptr += k0 * stride_kt + kvh * stride_kh
    kr_ptr += k0 * stride_krt + kvh * stride_krh
    v_ptr += k0 * stride_vt + kvh * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    first = prefix + mb * BLOCK_M  # the block's first query position: keys below it are seen by every row
    hi = tl.minimum(s, first + BLOCK_M)
    lo = 0
    if WINDOW:  # keys at or below (last position - window) are seen by no row
        lo = tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N
    free = (first + 1) // BLOCK_N * BLOCK_N  # blocks wholly at or below the first row's position
    if WINDOW:  # ...and above the last row's window start
        free = lo
    free = tl.maximum(free, lo)
    acc, m_i, l_i = _attend_blocks(acc, m_i, l_i, q, q_r, k_ptr, kr_ptr, v_ptr, pos, lo, free, window,
                                   scale_log2, stride_kt, stride_krt, stride_vt, cd, cr, cv, D, R, DV, BLOCK_N, HAS_ROPE,
                                   False, WINDOW, WIDE, PRECISION, UPCAST)
    acc, m_i, l_i = _attend_blocks(acc, m_i, l_i, q, q_r, k_ptr, kr_ptr, v_ptr, pos, free, hi, window,
                                   scale_log2, stride_kt, stride_krt, stride_vt, cd, cr, cv, D, R, DV, BLOCK_N, HAS_ROPE,
                                   True, WINDOW, WIDE, PRECISION, UPCAST)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + (q0 + offs_m)[:, None] * stride_ot + h * stride_oh + cv[None, :],
             out.to(o_ptr.dtype.element_ty), mask=mm[:, None] & (cv < DV)[None, :])


_KERNEL = DirectLauncher(_extend_attention_kernel)


def default_config(d: int, r: int, dv: int, dtype: torch.dtype, max_extend: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for these head dims and the longest request. Measured on an H200
    at MLA's 128 + 64 / 128 (benchmark/experiments/bench_extend_attention.py): 128/64/8/3 fastest from 2,048 new tokens a
    request (265-410 TFLOP/s), 64/64/4/2 on short ones (serving's 128-768 token prompts: 164 against 149)."""
    if dtype == torch.float32:
        return 32, 32, 4, 2
    if max_extend <= 1024:
        return 64, 64, 4, 2
    return 128, 64, 8, 3


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: torch.Tensor, max_extend: int,
                     scale: float, q_rope: torch.Tensor | None = None, k_rope: torch.Tensor | None = None,
                     sliding_window: int | None = None,
                     config: tuple[int, int, int, int] | None = None, wide: bool | None = None) -> torch.Tensor:
    """Same signature as moeserve.kernels.extend_attention.extend_attention_reference (plus the launch
    configuration: BLOCK_M, BLOCK_N, num_warps, num_stages; and wide: 64-bit key addresses, by default where the
    keys span 2^31 elements)."""
    T, Hq, D = q.shape
    S, Hkv, DV = v.shape
    has_rope = q_rope is not None
    if k.shape[:2] != (S, Hkv) or k.shape[2] != D or Hq % Hkv or seqs.dim() != 2 or seqs.shape[1] != 4 \
            or has_rope != (k_rope is not None) or (has_rope and (q_rope.shape[:2] != (T, Hq)
                                                                   or k_rope.shape[0] != S
                                                                   or k_rope.shape[-1] != q_rope.shape[-1])):
        raise ValueError(f"extend_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, seqs "
                         f"{tuple(seqs.shape)}, q_rope {None if q_rope is None else tuple(q_rope.shape)} and k_rope "
                         f"{None if k_rope is None else tuple(k_rope.shape)} do not fit")
    for t in (q, k, v, q_rope, k_rope):
        assert t is None or t.stride(-1) == 1, "the head dimension must be contiguous"
    out = q.new_empty(T, Hq, DV)
    B = seqs.shape[0]
    if T == 0 or B == 0:
        return out
    R = q_rope.shape[-1] if has_rope else 0
    qr, kr = (q_rope, k_rope) if has_rope else (q, k)
    kr_head = (0 if kr.dim() == 2 else kr.stride(1)) if has_rope else 0
    bm, bn, warps, stages = config or default_config(D, R, DV, q.dtype, max_extend)
    # tl.dot needs K >= 16: narrower heads (the tiny test models') are padded with masked zeros
    bd, br, bdv = (max(16, triton.next_power_of_2(x)) for x in (D, max(R, 1), DV))
    _KERNEL((triton.cdiv(max_extend, bm), Hq, B), q, qr, k, kr, v, out, seqs, float(scale) * LOG2E,
            int(sliding_window or 0), q.stride(0), q.stride(1), qr.stride(0), qr.stride(1) if has_rope else 0,
            k.stride(0), k.stride(1), kr.stride(0), kr_head, v.stride(0), v.stride(1), out.stride(0), out.stride(1),
            GROUP=Hq // Hkv, D=D, R=R, DV=DV, BLOCK_D=bd, BLOCK_R=br, BLOCK_DV=bdv, BLOCK_M=bm, BLOCK_N=bn,
            HAS_ROPE=has_rope, WINDOW=sliding_window is not None,
            WIDE=wide if wide is not None else max(S * k.stride(0), S * v.stride(0), S * kr.stride(0)) >= 2**31,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            UPCAST=not q.is_cuda and q.dtype != torch.float32,  # only under TRITON_INTERPRET (CPU tensors)
            num_warps=warps, num_stages=stages)
    return out
