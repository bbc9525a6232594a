"""Triton `argmax_or_none` (moeserve/kernels/argmax.py): out [B] int64 = the first index of each row's
maximum of scores [B, V] float32, or no_token where that maximum is not finite (a NaN, +inf, all -inf).

Two launches. Stage 1, grid (B, S): program (b, s) scans chunk s of row b, `steps` loads of BLOCK elements,
keeping per lane the largest value seen and its index (strictly larger replaces, so a lane keeps its first
index of a tie), then reduces the lanes to the chunk's max and the lowest index holding it, written to fp32 /
int32 partials [B, S]. NaN is read as +inf: a NaN row then has a +inf maximum, the same answer (no_token)
torch's first-NaN argmax leads to, and no comparison ever sees a NaN. Stage 2, grid (B,): one program a row
reduces its S partials the same way (ties to the lowest index, so the lowest chunk) and writes the index, or
no_token where the max is +-inf.

`steps` is chosen per V so that a row spreads over at most MAX_PARTS programs: at V = 102,400, 2 steps of 512,
100 programs (V3's 129,280: 127). Index math is int32 (V below 2**31); the row offset is int64."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.triton_ops.direct_launch import DirectLauncher

BLOCK = 512  # elements a program loads a step: 4 fp32 (one 16-byte load) a thread at 4 warps
MAX_PARTS = 128  # programs a row at most: about one for each of the H200's 132 SMs at batch 1
_INT_MAX = 2**31 - 1


@triton.jit
def _argmax_partial_kernel(scores_ptr, part_val_ptr, part_idx_ptr, V, stride_row, steps, S,
                           BLOCK: tl.constexpr):
    b = tl.program_id(0)
    s = tl.program_id(1)
    row = scores_ptr + b.to(tl.int64) * stride_row
    lanes = tl.arange(0, BLOCK)
    best_val = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    best_idx = tl.full((BLOCK,), 2**31 - 1, dtype=tl.int32)
    lo = s * steps * BLOCK
    for k in range(0, steps):
        offs = lo + k * BLOCK + lanes
        x = tl.load(row + offs, mask=offs < V, other=float("-inf"))
        x = tl.where(x != x, float("inf"), x)  # NaN -> +inf
        take = x > best_val  # strict: a lane's earlier index wins a tie
        best_val = tl.where(take, x, best_val)
        best_idx = tl.where(take, offs, best_idx)
    chunk_max = tl.max(best_val, axis=0)
    # the lowest index holding the max, by hand: no reliance on tl.argmax's tie-breaking
    chunk_idx = tl.min(tl.where(best_val == chunk_max, best_idx, 2**31 - 1), axis=0)
    tl.store(part_val_ptr + b * S + s, chunk_max)
    tl.store(part_idx_ptr + b * S + s, chunk_idx)


@triton.jit
def _argmax_final_kernel(part_val_ptr, part_idx_ptr, out_ptr, S, no_token, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    parts = tl.arange(0, BLOCK_S)
    pm = parts < S
    val = tl.load(part_val_ptr + b * S + parts, mask=pm, other=float("-inf"))
    idx = tl.load(part_idx_ptr + b * S + parts, mask=pm, other=2**31 - 1)
    row_max = tl.max(val, axis=0)
    row_idx = tl.min(tl.where(val == row_max, idx, 2**31 - 1), axis=0)
    finite = (row_max < float("inf")) & (row_max > float("-inf"))  # partials hold no NaN
    tl.store(out_ptr + b, tl.where(finite, row_idx.to(tl.int64), no_token))


_PARTIAL = DirectLauncher(_argmax_partial_kernel)
_FINAL = DirectLauncher(_argmax_final_kernel)


def split(V: int) -> tuple[int, int]:
    """(steps, S): BLOCK-loads a program and programs a row, S <= MAX_PARTS."""
    steps = triton.cdiv(triton.cdiv(V, BLOCK), MAX_PARTS)
    return steps, triton.cdiv(V, steps * BLOCK)


def argmax_or_none(scores: torch.Tensor, no_token: int) -> torch.Tensor:
    """scores [B, V] float32 (rows may be strided) -> [B] int64: the first index of each row's max, or
    no_token where the max is not finite or the row holds a NaN."""
    if scores.dim() != 2 or scores.dtype != torch.float32 or scores.shape[1] < 1:
        raise ValueError(f"argmax_or_none: scores {tuple(scores.shape)} {scores.dtype} is not a "
                         f"[B, V >= 1] float32 matrix")
    B, V = scores.shape
    steps, S = split(V)
    assert S * steps * BLOCK <= _INT_MAX, V  # int32 offsets within a row
    out = torch.empty(B, dtype=torch.int64, device=scores.device)
    if B == 0:
        return out
    scores = scores if scores.stride(1) == 1 else scores.contiguous()
    part_val = torch.empty(B, S, dtype=torch.float32, device=scores.device)
    part_idx = torch.empty(B, S, dtype=torch.int32, device=scores.device)
    _PARTIAL((B, S), scores, part_val, part_idx, V, scores.stride(0), steps, S, BLOCK=BLOCK, num_warps=4)
    _FINAL((B,), part_val, part_idx, out, S, no_token, BLOCK_S=triton.next_power_of_2(S), num_warps=1)
    return out
