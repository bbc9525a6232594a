"""Grouped GEMM, the local dispatcher and the fused experts in both layouts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.core.layouts import MaskedLayout
from moeserve.ep import DispatchOptions, make_dispatcher
from moeserve.ep.local import LocalDispatcher
from moeserve.kernels.grouped_gemm import grouped_gemm, grouped_gemm_reference
from moeserve.layers.moe.experts import Experts

GEN = torch.Generator().manual_seed(0)


def _experts(E=6, H=32, inter=24) -> Experts:
    ex = Experts(H, inter, E, list(range(E)))
    with torch.no_grad():
        ex.w13.copy_(torch.randn(ex.w13.shape, generator=GEN) * H**-0.5)
        ex.w2.copy_(torch.randn(ex.w2.shape, generator=GEN) * inter**-0.5)
    return ex


def _naive_moe(x, ids, weights, ex: Experts) -> torch.Tensor:
    """sum_k w_k * expert_{ids_k}(x), one token and one expert at a time."""
    out = torch.zeros_like(x)
    inter = ex.intermediate_size
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = ex.w13[e] @ x[t]
            out[t] += weights[t, j] * (ex.w2[e] @ (F.silu(h[:inter]) * h[inter:]))
    return out


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 7], [2, 2, 2, 2]])
@pytest.mark.parametrize("align", [1, 4])
def test_grouped_gemm_matches_reference(counts, align):
    E, K, N = len(counts), 16, 24
    padded = [(c + align - 1) // align * align for c in counts]
    offsets = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.randn(int(offsets[-1]) + 3, K, generator=GEN)
    w = torch.randn(E, N, K, generator=GEN)
    n = torch.tensor(counts, dtype=torch.int32)
    ref = grouped_gemm_reference(x, w, offsets, n)
    out = grouped_gemm(x, w, offsets, n)
    for e, c in enumerate(counts):
        rows = slice(int(offsets[e]), int(offsets[e]) + c)
        torch.testing.assert_close(out[rows], x[rows] @ w[e].t())
        torch.testing.assert_close(ref[rows], x[rows] @ w[e].t())


@pytest.mark.parametrize("align", [1, 8])
def test_local_dispatch_experts_combine_equals_naive(align):
    ex = _experts()
    T, k = 13, 3
    x = torch.randn(T, 32, generator=GEN)
    ids = torch.stack([torch.randperm(6, generator=GEN)[:k] for _ in range(T)])
    ids[0] = torch.tensor([5, 5, 5])  # one expert picked repeatedly still counts once per pick
    weights = torch.rand(T, k, generator=GEN)
    d = LocalDispatcher(6, align=align)
    d.dispatch_a(x, ids, weights, None)
    layout = d.dispatch_b()
    offs, n = layout.expert_offsets, layout.num_tokens_per_expert
    assert offs.dtype == torch.int32 and n.dtype == torch.int32
    assert n.tolist() == torch.bincount(ids.flatten(), minlength=6).tolist()
    assert all(int(offs[e]) % align == 0 for e in range(7))
    d.combine_a(ex(layout))
    with torch.no_grad():
        torch.testing.assert_close(d.combine_b(), _naive_moe(x, ids, weights, ex), atol=1e-5, rtol=1e-5)


def test_masked_layout_equals_contiguous():
    ex = _experts(E=4)
    cap = 5
    masked_m = torch.tensor([2, 0, 5, 3], dtype=torch.int32)
    x = torch.randn(4, cap, 32, generator=GEN)
    with torch.no_grad():
        out = ex(MaskedLayout(x=x, masked_m=masked_m))
        assert out.shape == (4, cap, 32)
        for e in range(4):
            m = int(masked_m[e])
            if m:
                ids = torch.full((m, 1), e)
                torch.testing.assert_close(out[e, :m], _naive_moe(x[e, :m], ids, torch.ones(m, 1), ex),
                                           atol=1e-5, rtol=1e-5)


def test_empty_dispatch():
    d = LocalDispatcher(4)
    x = torch.zeros(0, 8)
    d.dispatch_a(x, torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2), None)
    layout = d.dispatch_b()
    assert layout.x.shape == (0, 8) and layout.num_tokens_per_expert.tolist() == [0] * 4
    ex = Experts(8, 4, 4, range(4))
    with torch.no_grad():
        ex.w13.zero_()
        ex.w2.zero_()
    d.combine_a(ex(layout))
    assert d.combine_b().shape == (0, 8)


def test_make_dispatcher():
    cpu = dict(dtype=torch.float32, device="cpu")
    assert isinstance(make_dispatcher(DispatchOptions("none"), 8, 8, **cpu), LocalDispatcher)
    with pytest.raises(ValueError, match="allgather or all2all"):
        make_dispatcher(DispatchOptions("none"), 8, 4, **cpu)
    with pytest.raises(ValueError, match="unknown"):
        make_dispatcher(DispatchOptions("nccl"), 8, 8, **cpu)


def test_grouped_gemm_static_equals_reference():
    """The capture-safe fallback (no host reads) computes what the reference does."""
    from moeserve.kernels.grouped_gemm import _grouped_gemm_static, grouped_gemm_reference

    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(12, 8, generator=g), torch.randn(4, 6, 8, generator=g)
    offsets, counts = torch.tensor([0, 3, 3, 9, 12]), torch.tensor([2, 0, 5, 3])
    ref = grouped_gemm_reference(x, w, offsets, counts)
    got = _grouped_gemm_static(x, w, offsets, counts)
    valid = torch.cat([torch.arange(int(o), int(o) + int(c)) for o, c in zip(offsets[:-1], counts, strict=True)])
    torch.testing.assert_close(got[valid], ref[valid])


def test_triton_runner_backend_is_refused_off_cuda():
    """--moe-runner-backend triton names CUDA: on the CPU the load says so instead of running something else."""
    ex = Experts(32, 16, 4, list(range(4)), runner_backend="triton")
    with pytest.raises(ValueError, match="--moe-runner-backend triton runs on CUDA"):
        ex.process_weights_after_loading(torch.device("cpu"))
