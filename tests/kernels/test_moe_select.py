"""The Triton and the CPU (C++) expert selections against their torch reference: every gate variant, group limits,
bias, renormalization and scaling, on fresh random logits of shapes that are not powers of two."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels import cpu_moe_select
from moeserve.kernels.moe_select import select_experts, select_experts_reference

VARIANTS = {
    "softmax top-k (Mixtral, V2-Lite)": dict(E=64, k=6),
    "sigmoid, renormalized, scaled": dict(E=60, k=4, scoring_func="sigmoid", renormalize=True,
                                          routed_scaling_factor=2.5),
    "V2 group_limited_greedy": dict(E=160, k=6, topk_method="group_limited_greedy", n_group=8, topk_group=3),
    "V3 noaux_tc": dict(E=256, k=8, scoring_func="sigmoid", topk_method="noaux_tc", n_group=8, topk_group=4,
                        bias=True, renormalize=True, routed_scaling_factor=2.5),
    "noaux_tc, odd groups": dict(E=24, k=3, scoring_func="sigmoid", topk_method="noaux_tc", n_group=3,
                                 topk_group=2, bias=True),
    "noaux_tc, one expert a group": dict(E=12, k=2, scoring_func="sigmoid", topk_method="noaux_tc", n_group=12,
                                         topk_group=5, bias=True),
    "top-1 of 7": dict(E=7, k=1),
    "k = 9": dict(E=33, k=9, renormalize=True),
}


def _sorted(ids: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), w.gather(1, order)


@pytest.mark.parametrize("T", [1, 6])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_select_matches_reference(name, T, device):
    from moeserve.kernels.triton_ops.moe_select import select_experts

    v = dict(VARIANTS[name])
    E, k, with_bias = v.pop("E"), v.pop("k"), v.pop("bias", False)
    gen = torch.Generator().manual_seed(T * 1000 + E * 10 + k)
    logits = torch.randn(T, E, generator=gen) * 3
    bias = torch.randn(E, generator=gen) * 0.5 if with_bias else None
    ref_ids, ref_w = _sorted(*select_experts_reference(logits, k, correction_bias=bias, **v))
    ids, w = select_experts(logits.to(device), k, correction_bias=None if bias is None else bias.to(device), **v)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == (T, k)
    ids, w = _sorted(ids.cpu(), w.cpu())
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["V3 noaux_tc", "top-1 of 7"])
def test_appended_columns(name, device):
    """append=(first, n): the fused shared experts after the top k, weight 1, in both."""
    from moeserve.kernels.triton_ops.moe_select import select_experts

    v = dict(VARIANTS[name])
    E, k, with_bias = v.pop("E"), v.pop("k"), v.pop("bias", False)
    gen = torch.Generator().manual_seed(E + k)
    logits = torch.randn(4, E, generator=gen)
    bias = torch.randn(E, generator=gen) if with_bias else None
    ref_ids, ref_w = select_experts_reference(logits, k, correction_bias=bias, append=(E, 2), **v)
    ids, w = select_experts(logits.to(device), k, correction_bias=None if bias is None else bias.to(device),
                            append=(E, 2), **v)
    ids, w = ids.cpu(), w.cpu()
    assert ids.shape == (4, k + 2) and torch.equal(ids[:, k:], torch.tensor([[E, E + 1]] * 4))
    assert torch.equal(w[:, k:], torch.ones(4, 2)) and torch.equal(ref_w[:, k:], torch.ones(4, 2))
    got, ref = _sorted(ids[:, :k], w[:, :k]), _sorted(ref_ids[:, :k], ref_w[:, :k])
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1])


def test_strided_logits(device):
    """A column slice of a wider logits buffer (what a fused gate projection could hand over)."""
    from moeserve.kernels.triton_ops.moe_select import select_experts

    wide = torch.randn(9, 80, generator=torch.Generator().manual_seed(2))
    logits = wide[:, :64]
    ref = _sorted(*select_experts_reference(logits, 6))
    got = _sorted(*[t.cpu() for t in select_experts(logits.to(device), 6)])
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="many tokens: on the GPU only (slow when interpreted)")
@pytest.mark.parametrize("name", ["softmax top-k (Mixtral, V2-Lite)", "V3 noaux_tc"])
def test_select_many_tokens(name):
    test_select_matches_reference(name, 4099, "cuda")


@pytest.mark.skipif(cpu_moe_select.load() is None, reason="no C++ compiler: the kernel cannot build")
@pytest.mark.parametrize("T", [1, 6, 300])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_cpu_select_matches_reference(name, T):
    """select_experts on CPU tensors runs the C++ kernel (300 tokens: split over the threads); the ids the
    reference's, the weights to an fp32 rounding (the renormalizing sum in another order)."""
    v = dict(VARIANTS[name])
    E, k, with_bias = v.pop("E"), v.pop("k"), v.pop("bias", False)
    gen = torch.Generator().manual_seed(T * 1000 + E * 10 + k + 7)
    logits = torch.randn(T, E, generator=gen) * 3
    bias = torch.randn(E, generator=gen) * 0.5 if with_bias else None
    assert cpu_moe_select.takes(logits)
    ref_ids, ref_w = _sorted(*select_experts_reference(logits, k, correction_bias=bias, **v))
    ids, w = select_experts(logits, k, correction_bias=bias, **v)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == (T, k)
    ids, w = _sorted(ids, w)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(cpu_moe_select.load() is None, reason="no C++ compiler: the kernel cannot build")
def test_cpu_select_appends_and_refuses_bad_variants():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 24, generator=gen)
    ids, w = select_experts(logits, 3, scoring_func="sigmoid", topk_method="noaux_tc", n_group=3, topk_group=2,
                            append=(24, 1))
    assert torch.equal(ids[:, 3], torch.full((3,), 24)) and torch.equal(w[:, 3], torch.ones(3))
    ref = _sorted(*select_experts_reference(logits, 3, scoring_func="sigmoid", topk_method="noaux_tc", n_group=3,
                                            topk_group=2))
    assert torch.equal(_sorted(ids[:, :3], w[:, :3])[0], ref[0])
    for bad in (dict(scoring_func="tanh"), dict(topk_method="random"), dict(topk_method="noaux_tc", n_group=5)):
        with pytest.raises(ValueError):
            cpu_moe_select.cpu_select_experts(logits, 3, **bad)
    with pytest.raises(ValueError):
        cpu_moe_select.cpu_select_experts(logits, 25)
