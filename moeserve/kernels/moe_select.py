"""Expert selection from router logits, in one pass: scoring, the correction bias, group limits, top-k, the weights.

    select_experts(router_logits [T, E] fp32, top_k, scoring_func, topk_method, n_group, topk_group,
                   correction_bias [E] | None, renormalize, routed_scaling_factor)
        -> (topk_ids [T, k] int64, topk_weights [T, k] fp32)

append=(first, n): n more columns, ids first .. first + n - 1 with weight 1 (the fused shared experts of
--enable-shared-experts-fusion, as slots after the routed ones): [T, k + n].

The variants are moeserve/layers/moe/router.py's (DeepSeek's names). `select_experts_reference` is the torch
sequence (softmax or sigmoid, add, grouped top-2 sums, top-k of the groups, scatter, mask, top-k, gather, sums):
5 kernels for a plain top-k of softmax scores, 15 for DeepSeek-V3's grouped gate. On CUDA the Triton kernel
(triton_ops/moe_select.py) does all of it in one launch, one program per token; on the CPU a C++ kernel does all but
the scoring (cpu_moe_select.py). The k ids come in no particular
order in either (the MoE sums over them); ties between equal scores may pick different experts.
"""

from __future__ import annotations

import torch

from moeserve.kernels import cpu_moe_select
from moeserve.kernels.triton_available import use_triton

MAX_EXPERTS = 1024  # the Triton kernel holds a token's scores in one block


def select_experts(router_logits: torch.Tensor, top_k: int, **variant) -> tuple[torch.Tensor, torch.Tensor]:
    """Module docstring; `variant`: select_experts_reference's keywords. Triton on CUDA, C++ on the CPU
    (cpu_moe_select.py), the reference elsewhere and under torch.compile."""
    if (use_triton(router_logits) and router_logits.shape[0] > 0 and router_logits.shape[-1] <= MAX_EXPERTS
            and not torch.compiler.is_compiling()):
        from moeserve.kernels.triton_ops.moe_select import select_experts as triton_select_experts

        return triton_select_experts(router_logits, top_k, **variant)
    if cpu_moe_select.takes(router_logits):
        append = variant.pop("append", None)
        ids, weights = cpu_moe_select.cpu_select_experts(router_logits, top_k, **variant)
        if append is None:
            return ids, weights
        return append_slots(ids, weights, torch.arange(append[0], append[0] + append[1]))
    return select_experts_reference(router_logits, top_k, **variant)


def select_experts_reference(router_logits: torch.Tensor, top_k: int, *, scoring_func: str = "softmax",
                             topk_method: str = "greedy", n_group: int = 1, topk_group: int = 1,
                             correction_bias: torch.Tensor | None = None, renormalize: bool = False,
                             routed_scaling_factor: float = 1.0,
                             append: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] float32 -> (topk_ids [T, k] int64 logical ids, topk_weights [T, k] float32); the k
    ids in no particular order."""
    T, E = router_logits.shape
    logits = router_logits.float()
    if scoring_func == "softmax":
        scores = logits.softmax(dim=-1)
    elif scoring_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"unknown scoring_func {scoring_func!r}")
    # The bias only chooses experts; the weights come from the unbiased scores.
    choice = scores if correction_bias is None else scores + correction_bias.float()

    if topk_method in ("group_limited_greedy", "noaux_tc") and n_group > 1:
        grouped = choice.view(T, n_group, E // n_group)
        if topk_method == "noaux_tc":
            group_scores = grouped.topk(min(2, E // n_group), dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        expert_mask = group_mask[:, :, None].expand(T, n_group, E // n_group).reshape(T, E)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    elif topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ValueError(f"unknown topk_method {topk_method!r}")

    topk_ids = choice.topk(top_k, dim=-1, sorted=False).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    if append is not None:
        first, n = append
        return append_slots(topk_ids, topk_weights, torch.arange(first, first + n, device=topk_ids.device))
    return topk_ids, topk_weights


def append_slots(topk_ids: torch.Tensor, topk_weights: torch.Tensor, slots: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, k] ids and weights -> [T, k + n]: every token also picks `slots` [n], with weight 1 (what `append` does)."""
    T, n = topk_ids.shape[0], slots.shape[0]
    return (torch.cat((topk_ids, slots[None].expand(T, n)), dim=1),
            torch.cat((topk_weights, topk_weights.new_ones(T, n)), dim=1))
