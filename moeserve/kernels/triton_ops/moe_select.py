"""Triton `select_experts` (moeserve/kernels/moe_select.py): one program per token holds its E router logits as a
[groups, experts per group] block (one group without group limits) and does the whole selection in registers:
scores, bias, the groups' scores (best, or best two summed), the top groups by repeated argmax, then the top k
experts likewise (the lowest id among equal scores), their unbiased scores as weights, renormalized and scaled;
then the appended columns (fused shared experts), weight 1."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.triton_ops.direct_launch import DirectLauncher


@triton.jit
def _select_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, stride_l, scale, append_first,
                   G: tl.constexpr, EG: tl.constexpr, G_P2: tl.constexpr, EG_P2: tl.constexpr,
                   TOPK: tl.constexpr, TOPK_P2: tl.constexpr, TOPK_GROUP: tl.constexpr, SIGMOID: tl.constexpr,
                   HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr, TOP2: tl.constexpr, RENORM: tl.constexpr,
                   N_APPEND: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, G_P2)[:, None]
    j = tl.arange(0, EG_P2)[None, :]
    ok = (g < G) & (j < EG)
    e = g * EG + j  # each element's expert id
    x = tl.load(logits_ptr + t * stride_l + e, mask=ok, other=-float("inf")).to(tl.float32)
    if SIGMOID:
        scores = tl.sigmoid(x)
    else:
        p = tl.exp(x - tl.max(tl.max(x, axis=1), axis=0))
        scores = p / tl.sum(tl.sum(p, axis=1), axis=0)
    scores = tl.where(ok, scores, 0.0)
    choice = scores
    if HAS_BIAS:  # the bias only chooses; the weights stay the unbiased scores
        choice += tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32)
    choice = tl.where(ok, choice, -float("inf"))
    if GROUPED:
        best = tl.max(choice, axis=1)  # [G_P2]
        if TOP2:  # the sum of each group's two best (the first best's lowest column masked out)
            first = tl.min(tl.where(choice == best[:, None], j, EG_P2), axis=1)
            best += tl.max(tl.where(j == first[:, None], -float("inf"), choice), axis=1)
        gid = tl.arange(0, G_P2)
        best = tl.where(gid < G, best, -float("inf"))
        keep = gid < 0
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.min(tl.where(best == tl.max(best, axis=0), gid, G_P2), axis=0)
            keep = keep | (gid == top)
            best = tl.where(gid == top, -float("inf"), best)
        choice = tl.where(keep[:, None], choice, -float("inf"))
    slot = tl.arange(0, TOPK_P2)
    ids = tl.zeros((TOPK_P2,), dtype=tl.int64)
    weights = tl.zeros((TOPK_P2,), dtype=tl.float32)
    for i in tl.static_range(TOPK):
        m = tl.max(tl.max(choice, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(choice == m, e, G * EG), axis=1), axis=0)
        wt = tl.sum(tl.sum(tl.where(e == pick, scores, 0.0), axis=1), axis=0)
        ids = tl.where(slot == i, pick.to(tl.int64), ids)
        weights = tl.where(slot == i, wt, weights)
        choice = tl.where(e == pick, -float("inf"), choice)
    if RENORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    weights = weights * scale
    row = t * (TOPK + N_APPEND)
    tl.store(ids_ptr + row + slot, ids, mask=slot < TOPK)
    tl.store(w_ptr + row + slot, weights, mask=slot < TOPK)
    for i in tl.static_range(N_APPEND):
        tl.store(ids_ptr + row + TOPK + i, (append_first + i).to(tl.int64))
        tl.store(w_ptr + row + TOPK + i, 1.0)


_SELECT = DirectLauncher(_select_kernel)


def select_experts(router_logits: torch.Tensor, top_k: int, *, scoring_func: str = "softmax",
                   topk_method: str = "greedy", n_group: int = 1, topk_group: int = 1,
                   correction_bias: torch.Tensor | None = None, renormalize: bool = False,
                   routed_scaling_factor: float = 1.0,
                   append: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same signature as moeserve.kernels.moe_select.select_experts_reference."""
    if scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"unknown scoring_func {scoring_func!r}")
    if topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ValueError(f"unknown topk_method {topk_method!r}")
    T, E = router_logits.shape
    grouped = topk_method in ("group_limited_greedy", "noaux_tc") and n_group > 1
    G = n_group if grouped else 1
    EG = E // G
    logits = router_logits.float()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    first, n = append if append is not None else (0, 0)
    ids = torch.empty(T, top_k + n, dtype=torch.int64, device=logits.device)
    weights = torch.empty(T, top_k + n, dtype=torch.float32, device=logits.device)
    bias = correction_bias.float() if correction_bias is not None else logits  # (unread without a bias)
    _SELECT((T,), logits, bias, ids, weights, logits.stride(0), float(routed_scaling_factor), first,
            G=G, EG=EG, G_P2=triton.next_power_of_2(G), EG_P2=triton.next_power_of_2(EG), TOPK=top_k,
            TOPK_P2=triton.next_power_of_2(top_k), TOPK_GROUP=topk_group if grouped else 1,
            SIGMOID=scoring_func == "sigmoid", HAS_BIAS=correction_bias is not None, GROUPED=grouped,
            TOP2=topk_method == "noaux_tc" and EG >= 2, RENORM=renormalize, N_APPEND=n, num_warps=2)
    return ids, weights
