"""The MoE gate: router logits in float32, then `select_experts` picks each token's top-k experts and weights.

Variants (DeepSeek names):
- greedy:                top-k of softmax (or sigmoid) scores (Mixtral, Qwen3-MoE, DeepSeek-V2-Lite)
- group_limited_greedy:  experts in n_group groups; keep the topk_group groups with the best single expert,
                         then top-k inside them (DeepSeek-V2)
- noaux_tc:              sigmoid scores plus a per-expert correction bias choose: groups ranked by the sum of
                         their best two biased scores, top-k among the kept groups; the weights are the unbiased
                         scores (DeepSeek-V3)
Then optionally renormalize the k weights to sum to 1, and multiply by routed_scaling_factor. The selection is
moeserve/kernels/moe_select.py: one Triton kernel on CUDA, its torch reference elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from moeserve.kernels.moe_select import select_experts
from moeserve.kernels.router_gemm import router_logits
from moeserve.layers.weights import WeightSpec


class TopKRouter(nn.Module):
    """The MoE gate: x [T, H] -> (topk_ids [T, k] int64 logical expert ids, topk_weights [T, k] float32).

    Holds the gate weight [E, H] (and DeepSeek-V3's e_score_correction_bias [E]) in float32; the variant (scoring,
    grouping, renormalization, scaling) is fixed at construction, from the model's config."""

    fp32_params = ("weight", "e_score_correction_bias")  # the loader allocates these in float32

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, scoring_func: str = "softmax",
                 topk_method: str = "greedy", n_group: int = 1, topk_group: int = 1, renormalize: bool = False,
                 routed_scaling_factor: float = 1.0, correction_bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(num_experts), requires_grad=False) if correction_bias else None
        )
        self.top_k = top_k
        self.variant = dict(scoring_func=scoring_func, topk_method=topk_method, n_group=n_group,
                            topk_group=topk_group, renormalize=renormalize,
                            routed_scaling_factor=routed_scaling_factor)
        self.append: tuple[int, int] | None = None  # (first slot, n): fused shared experts after the top k
        self.fake = False  # --ep-dispatch-algorithm fake: k distinct experts uniformly at random (the weights stay)

    def forward(self, x: torch.Tensor, append: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """append=False: without the fused shared experts' slots this call (they run apart)."""
        logits = router_logits(x, self.weight)  # [T, E] router logits in float32 (one kernel on CUDA)
        topk_ids, topk_weights = select_experts(logits, self.top_k, correction_bias=self.e_score_correction_bias,
                                                append=self.append if append else None, **self.variant)
        if self.fake:  # top k of uniform noise: k distinct experts, each equally likely (no host sync)
            topk_ids[:, :self.top_k] = torch.rand_like(logits).topk(self.top_k, dim=1).indices
        return topk_ids, topk_weights

    def weight_specs(self, prefix: str) -> Iterator[WeightSpec]:
        for name, p in self.named_parameters(recurse=False):
            yield WeightSpec(f"{prefix}.{name}", tuple(p.shape), f"{prefix}.{name}")
