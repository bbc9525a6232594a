"""The Triton combine (gather + top-k weighted sum) against its torch reference."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.moe_combine import moe_combine_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,k,M,H", [(1, 1, 3, 8), (9, 6, 60, 40), (4, 2, 5, 1100)])  # H past one 1024 block
def test_combine_matches_reference(dtype, T, k, M, H, device):
    from moeserve.kernels.triton_ops.moe_combine import moe_combine

    gen = torch.Generator().manual_seed(T * k + H)
    y = torch.randn(M, H, generator=gen).to(dtype)
    y[M - 1] = float("nan")  # a row nobody reads: must not leak into the sums
    rows = torch.randint(0, M - 1, (T, k), generator=gen)
    rows[torch.rand(T, k, generator=gen) < 0.25] = -1
    weights = torch.rand(T, k, generator=gen)
    ref = moe_combine_reference(y, rows, weights)
    got = moe_combine(y.to(device), rows.to(device), weights.to(device)).cpu()
    assert got.dtype == dtype and not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_adds_the_shared_output(dtype, device):
    """add (the shared experts' output) joins the fp32 sum: one rounding, the same as summing it by hand in fp32."""
    from moeserve.kernels.triton_ops.moe_combine import moe_combine

    gen = torch.Generator().manual_seed(3)
    y, add = torch.randn(30, 48, generator=gen).to(dtype), torch.randn(7, 48, generator=gen).to(dtype)
    rows = torch.randint(0, 30, (7, 3), generator=gen)
    rows[0, 1] = -1
    weights = torch.rand(7, 3, generator=gen)
    ref = moe_combine_reference(y, rows, weights, add=add)
    by_hand = (moe_combine_reference(y, rows, weights, torch.float32) + add.float()).to(dtype)
    torch.testing.assert_close(ref, by_hand, atol=0, rtol=0)
    got = moe_combine(y.to(device), rows.to(device), weights.to(device), add=add.to(device)).cpu()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    assert not torch.allclose(got.float(), moe_combine_reference(y, rows, weights).float(), atol=tol)  # it added
