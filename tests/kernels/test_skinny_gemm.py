"""The Triton GEMV for a few rows (skinny_gemm) against F.linear, and where the dispatch sends a call."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels import skinny_gemm as dispatch
from moeserve.kernels.skinny_gemm import skinny_gemm_reference


def _inputs(M: int, N: int, K: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(M, K, generator=gen).to(dtype), (torch.randn(N, K, generator=gen) * K**-0.5).to(dtype))


def _exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", [(1, 64, 256), (1, 9, 4096), (3, 40, 200), (8, 130, 96), (5, 7, 2100), (2, 1, 64)])
def test_skinny_gemm_matches_reference(dtype, M, N, K, device):
    from moeserve.kernels.triton_ops.skinny_gemm import skinny_gemm

    x, w = _inputs(M, N, K, dtype, M * N + K)
    got = skinny_gemm(x.to(device), w.to(device))
    assert got.dtype == dtype and got.shape == (M, N)
    # fp32 sums of exact products in another order; bf16: one rounding of the sum
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got.cpu(), _exact(x, w), **tol)


@pytest.mark.parametrize("block", [(2, 64, 4, 1, 1), (4, 32, 4, 3, 1), (1, 128, 2, 2, 1), (8, 32, 4, 1, 3)])
def test_other_blocks_and_split_k(block, device):
    """Blocks narrower than N, K in several steps, and K split over programs that add into one fp32 buffer."""
    from moeserve.kernels.triton_ops.skinny_gemm import skinny_gemm

    x, w = _inputs(6, 33, 300, torch.float32, 7)
    torch.testing.assert_close(skinny_gemm(x.to(device), w.to(device), block).cpu(), _exact(x, w),
                               atol=2e-5, rtol=2e-5)


def test_strided_rows_and_refusal(device):
    from moeserve.kernels.triton_ops.skinny_gemm import skinny_gemm

    x, w = _inputs(12, 24, 64, torch.float32, 3)
    torch.testing.assert_close(skinny_gemm(x.to(device)[::4], w.to(device)).cpu(), _exact(x[::4], w),
                               atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(skinny_gemm(x.to(device)[:2, ::2], w[:, :32].to(device)).cpu(),
                               _exact(x[:2, ::2], w[:, :32]), atol=2e-5, rtol=2e-5)  # x strided along K
    with pytest.raises(ValueError, match="do not fit"):
        skinny_gemm(x.to(device)[:2], w.to(device).half())
    with pytest.raises(ValueError, match="do not fit"):
        skinny_gemm(x.to(device)[:9], w.to(device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G,M,N,K", [(3, 1, 40, 24), (2, 4, 130, 72), (5, 2, 9, 200)])
def test_batched_per_group(dtype, G, M, N, K, device):
    """One GEMV per group against float64 bmm: w with K contiguous, and w stored [K, N] (MLA's W_UK as kv_b_proj
    holds it), x and out strided as the model passes them (heads the middle dimension of [B, h, d])."""
    from moeserve.kernels.triton_ops.skinny_gemm import batched_skinny_gemm

    gen = torch.Generator().manual_seed(G * 100 + M * 10 + N + K)
    x = torch.randn(M, G, K + 5, generator=gen).to(dtype)[..., :K].transpose(0, 1)  # [G, M, K], rows strided
    w_nk = (torch.randn(G, N, K, generator=gen) * K**-0.5).to(dtype)
    w_kn = (torch.randn(G, K + 3, N, generator=gen) * K**-0.5).to(dtype)[:, :K].transpose(1, 2)  # N contiguous
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for w in (w_nk, w_kn):
        exact = (x.double() @ w.double().transpose(1, 2)).to(dtype)
        got = batched_skinny_gemm(x.to(device), w.to(device))
        assert got.shape == (G, M, N) and got.dtype == dtype
        torch.testing.assert_close(got.cpu(), exact, **tol)
        out = torch.full((M, G, N), float("nan"), dtype=dtype, device=device)
        batched_skinny_gemm(x.to(device), w.to(device), out=out.transpose(0, 1))  # written into [M, G, N]
        torch.testing.assert_close(out.transpose(0, 1).cpu(), exact, **tol)


@pytest.mark.parametrize("block", [(8, 16, 4, 1, 3), (32, 64, 4, 2, 1)])
def test_batched_kn_blocks_and_split_k(block, device):
    """The [K, N] weight read over several K steps, and K split over programs (out given: the fp32 sums copied
    into it)."""
    from moeserve.kernels.triton_ops.skinny_gemm import batched_skinny_gemm

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, 3, 100, generator=gen)
    w = (torch.randn(4, 100, 70, generator=gen) * 0.1).transpose(1, 2)  # [G, N, K], N contiguous
    exact = (x.double() @ w.double().transpose(1, 2)).float()
    out = torch.empty(4, 3, 70, device=device)
    batched_skinny_gemm(x.to(device), w.to(device), out, block)
    torch.testing.assert_close(out.cpu(), exact, atol=2e-5, rtol=2e-5)


def test_batched_dispatch(monkeypatch):
    """CPU tensors, more than one row, and weights over MAX_BATCHED_BYTES run torch.bmm; the rest the kernel."""
    calls = []
    monkeypatch.setattr(dispatch, "use_triton", lambda x: True)
    monkeypatch.setattr("moeserve.kernels.triton_ops.skinny_gemm.batched_skinny_gemm",
                        lambda x, w, out: calls.append(x.shape) or dispatch.batched_skinny_gemm_reference(x, w, out))
    x, w = torch.randn(16, 1, 128), torch.randn(16, 128, 512).transpose(1, 2)
    torch.testing.assert_close(dispatch.batched_skinny_gemm(x, w), torch.bmm(x, w.transpose(1, 2)))
    dispatch.batched_skinny_gemm(torch.randn(16, 2, 128), w)
    big = torch.randn(16, dispatch.MAX_BATCHED_BYTES // 4 // 16 // 128 + 1, 128)
    dispatch.batched_skinny_gemm(x, big)
    assert calls == [(16, 1, 128)]
    monkeypatch.setattr(dispatch, "use_triton", lambda x: False)
    dispatch.batched_skinny_gemm(x, w)
    assert calls == [(16, 1, 128)]


def test_dispatch(monkeypatch):
    """CPU tensors, more than MAX_ROWS rows, and more than MAX_WORK_BYTES of rows x weight past one row take
    F.linear; the rest the kernel, leading dimensions kept."""
    calls = []
    monkeypatch.setattr(dispatch, "use_triton", lambda x: True)
    monkeypatch.setattr("moeserve.kernels.triton_ops.skinny_gemm.skinny_gemm",
                        lambda x, w: calls.append(x.shape) or skinny_gemm_reference(x, w))
    big = torch.randn(dispatch.MAX_WORK_BYTES // 4 // 64 // 2, 64)  # two rows of x fit, three do not
    x = torch.randn(2, 1, 64)
    torch.testing.assert_close(dispatch.skinny_gemm(x, big), skinny_gemm_reference(x, big))
    assert calls == [(2, 64)]
    dispatch.skinny_gemm(torch.randn(3, 64), big)
    dispatch.skinny_gemm(torch.randn(dispatch.MAX_ROWS + 1, 64), big[:8])
    dispatch.skinny_gemm(torch.randn(1, 64), torch.cat([big, big, big]))  # one row: any size
    assert calls == [(2, 64), (1, 64)]
    with pytest.raises(RuntimeError):  # K does not fit: F.linear's own error
        dispatch.skinny_gemm(torch.randn(2, 64), big[:, :32])
    assert calls == [(2, 64), (1, 64)]
