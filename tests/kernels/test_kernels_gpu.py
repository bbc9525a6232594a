"""The Triton kernels at real model shapes on the GPU (skipped without CUDA), against their torch references in
fp32, and the whole MoE kernel chain replayed from a CUDA graph against eager.

Run on the GPU machine:  python3 -m pytest -o addopts="" tests/kernels/test_kernels_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.moe_combine import moe_combine, moe_combine_reference
from moeserve.kernels.moe_gemm import moe_gemm, moe_gemm_masked, moe_gemm_masked_reference, moe_gemm_reference
from moeserve.kernels.moe_route import moe_route, moe_route_reference
from moeserve.kernels.rms_norm import rms_norm, rms_norm_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _routing(T: int, E: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.rand(T, E, device="cuda", generator=gen).topk(k, dim=1).indices


@pytest.mark.parametrize("T,E,k,align", [(1, 64, 6, 1), (300, 64, 6, 1), (4096, 256, 8, 1), (77, 64, 6, 128)])
def test_route_real_shapes(T, E, k, align):
    ids = _routing(T, E, k, T)
    got, ref = moe_route(ids, E, align), moe_route_reference(ids, E, align)
    for name in ("counts", "offsets", "dest", "src"):
        assert torch.equal(getattr(got, name).long(), getattr(ref, name).long()), name


@pytest.mark.parametrize("T", [1, 64, 300, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_gemm_v2_lite_shapes(T, dtype):
    E, k, H, inter = 64, 6, 2048, 1408
    gen = torch.Generator(device="cuda").manual_seed(T)
    plan = moe_route(_routing(T, E, k, T + 1), E)
    x = torch.randn(plan.num_rows, H, device="cuda", generator=gen).to(dtype)
    w13 = (torch.randn(E, 2 * inter, H, device="cuda", generator=gen) * H**-0.5).to(dtype)
    w2 = (torch.randn(E, H, inter, device="cuda", generator=gen) * inter**-0.5).to(dtype)
    h = moe_gemm(x, w13, plan.offsets, plan.counts, silu=True)
    ref_h = moe_gemm_reference(x.float(), w13.float(), plan.offsets, plan.counts, silu=True)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    assert _rel(h, ref_h) < tol
    y = moe_gemm(h, w2, plan.offsets, plan.counts)
    assert _rel(y, moe_gemm_reference(h.float(), w2.float(), plan.offsets, plan.counts)) < tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_gemm_masked_real_shapes(dtype):
    E, C, H, inter = 8, 128, 2048, 1408
    gen = torch.Generator(device="cuda").manual_seed(5)
    masked_m = torch.tensor([0, 1, 128, 17, 64, 3, 100, 0], dtype=torch.int32, device="cuda")
    x = torch.randn(E, C, H, device="cuda", generator=gen).to(dtype)
    w13 = (torch.randn(E, 2 * inter, H, device="cuda", generator=gen) * H**-0.5).to(dtype)
    got = moe_gemm_masked(x, w13, masked_m, silu=True)
    ref = moe_gemm_masked_reference(x.float(), w13.float(), masked_m, silu=True)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    for e, m in enumerate(masked_m.tolist()):
        if m:
            assert _rel(got[e, :m], ref[e, :m]) < tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_combine_and_norm_real_shapes(dtype):
    gen = torch.Generator(device="cuda").manual_seed(9)
    T, k, H = 257, 6, 7168
    y = torch.randn(T * k, H, device="cuda", generator=gen).to(dtype)
    rows = torch.randperm(T * k, device="cuda", generator=gen).view(T, k)
    w = torch.rand(T, k, device="cuda", generator=gen)
    assert _rel(moe_combine(y, rows, w, torch.float32), moe_combine_reference(y.float(), rows, w)) < 1e-5
    x, res = (torch.randn(T, H, device="cuda", generator=gen).to(dtype) for _ in range(2))
    nw = torch.rand(H, device="cuda", generator=gen).to(dtype)
    (got, h), (ref, ref_h) = rms_norm(x, nw, 1e-6, res), rms_norm_reference(x, nw, 1e-6, res)
    assert _rel(h, ref_h) < 1e-2 and _rel(got, ref) < 1e-2


def test_moe_chain_graph_equals_eager():
    """route -> gate/up (SiLU) -> down -> combine, captured once and replayed on fresh routing and inputs."""
    E, k, H, inter, T = 64, 6, 512, 256, 48
    gen = torch.Generator(device="cuda").manual_seed(2)
    w13 = torch.randn(E, 2 * inter, H, device="cuda", generator=gen, dtype=torch.bfloat16) * H**-0.5
    w2 = torch.randn(E, H, inter, device="cuda", generator=gen, dtype=torch.bfloat16) * inter**-0.5
    x = torch.randn(T, H, device="cuda", generator=gen, dtype=torch.bfloat16)
    ids, wts = _routing(T, E, k, 3), torch.rand(T, k, device="cuda", generator=gen)

    def chain() -> torch.Tensor:
        plan = moe_route(ids, E)
        xs = x.index_select(0, plan.src.long() // k)
        h = moe_gemm(xs, w13, plan.offsets, plan.counts, silu=True)
        out = moe_gemm(h, w2, plan.offsets, plan.counts)
        return moe_combine(out, plan.dest.view(T, k), wts)

    chain()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for seed in (4, 5):
        ids.copy_(_routing(T, E, k, seed))
        x.copy_(torch.randn(T, H, device="cuda", generator=gen, dtype=torch.bfloat16))
        graph.replay()
        torch.testing.assert_close(out, chain(), rtol=0, atol=0)
