"""select_experts against transformers' router modules, each gate variant, on random hidden states."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.layers.moe.router import select_experts


def _sorted(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Order each row by expert id (the top-k order is unspecified)."""
    ids_sorted, perm = ids.sort(dim=-1)
    return ids_sorted, weights.gather(1, perm)


def _compare(hf_router, ours_kwargs: dict, hidden: int, seed: int, with_bias: bool = False) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        hf_router.weight.copy_(torch.randn(hf_router.weight.shape, generator=gen) * hidden**-0.5 * 3)
        bias = None
        if with_bias:
            hf_router.e_score_correction_bias.copy_(0.1 * torch.randn(hf_router.weight.shape[0], generator=gen))
            bias = hf_router.e_score_correction_bias
        x = torch.randn(257, hidden, generator=gen)
        _, ref_w, ref_ids = hf_router(x)
        ids, w = select_experts(F.linear(x, hf_router.weight.float()), correction_bias=bias, **ours_kwargs)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    ref_ids, ref_w = _sorted(ref_ids, ref_w.float())
    ids, w = _sorted(ids, w)
    torch.testing.assert_close(ids, ref_ids, atol=0, rtol=0)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("n_group,topk_group,norm", [(1, 1, True), (4, 2, True), (8, 3, False)])
def test_noaux_tc_sigmoid_with_bias_vs_deepseek_v3(n_group, topk_group, norm):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=64, n_routed_experts=32, num_experts_per_tok=6, n_group=n_group,
                           topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)
    _compare(DeepseekV3TopkRouter(cfg), dict(top_k=6, scoring_func="sigmoid", topk_method="noaux_tc",
                                             n_group=n_group, topk_group=topk_group, renormalize=norm,
                                             routed_scaling_factor=2.5), 64, seed=n_group, with_bias=True)


@pytest.mark.parametrize("method,n_group,topk_group", [("greedy", None, None), ("group_limited_greedy", 4, 2),
                                                       ("group_limited_greedy", 8, 3)])
def test_softmax_gates_vs_deepseek_v2(method, n_group, topk_group):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = DeepseekV2Config(hidden_size=64, num_attention_heads=4, n_routed_experts=32, num_experts_per_tok=6,
                           topk_method=method, n_group=n_group, topk_group=topk_group, routed_scaling_factor=16.0)
    _compare(DeepseekV2TopkRouter(cfg), dict(top_k=6, scoring_func="softmax", topk_method=method,
                                             n_group=n_group or 1, topk_group=topk_group or 1, renormalize=False,
                                             routed_scaling_factor=16.0), 64, seed=7)


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_topk_vs_qwen3_moe(norm):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = Qwen3MoeConfig(hidden_size=64, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm)
    _compare(Qwen3MoeTopKRouter(cfg), dict(top_k=4, renormalize=norm), 64, seed=3)


def test_softmax_top2_renormalized_vs_mixtral():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    cfg = MixtralConfig(hidden_size=64, num_local_experts=8, num_experts_per_tok=2)
    _compare(MixtralTopKRouter(cfg), dict(top_k=2, renormalize=True), 64, seed=4)


def test_bias_only_chooses():
    """A large bias on one expert makes it chosen everywhere, but its weight is still its unbiased score."""
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
    bias = torch.zeros(8)
    bias[5] = 10.0
    ids, w = select_experts(logits, 2, scoring_func="sigmoid", topk_method="noaux_tc", correction_bias=bias)
    assert (ids == 5).any(dim=1).all()
    pos = (ids == 5).nonzero()[:, 1]
    torch.testing.assert_close(w[torch.arange(50), pos], logits[:, 5].sigmoid())


def test_groups_limit_the_choice():
    """With topk_group 1 of 4 groups, every token's experts lie in one group."""
    logits = torch.randn(100, 16, generator=torch.Generator().manual_seed(1))
    ids, _ = select_experts(logits, 3, scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=1,
                            correction_bias=torch.zeros(16))
    groups = ids // 4
    assert (groups == groups[:, :1]).all()
