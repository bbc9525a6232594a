"""The Triton router logits (fp32 dot of activations in the model's dtype with fp32 gate weights) against torch's
upcast-and-linear."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.router_gemm import router_logits_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,H", [(1, 64, 256), (5, 8, 64), (40, 20, 200), (300, 16, 96), (16, 64, 512), (4, 64, 2048)])
def test_router_logits_match_reference(dtype, T, E, H, device):
    from moeserve.kernels.triton_ops.router_gemm import router_logits

    gen = torch.Generator().manual_seed(T + E + H)
    x = torch.randn(T, H, generator=gen).to(dtype)
    w = torch.randn(E, H, generator=gen) * H**-0.5
    got = router_logits(x.to(device), w.to(device))
    assert got.dtype == torch.float32 and got.shape == (T, E)
    # both sum the same fp32 products (x is exact in fp32), in different orders
    torch.testing.assert_close(got.cpu(), router_logits_reference(x, w), atol=2e-5, rtol=2e-5)


def test_strided_tokens_and_refusal(device):
    from moeserve.kernels.triton_ops.router_gemm import router_logits

    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(0))
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(router_logits(x.to(device)[::3], w.to(device)).cpu(),
                               router_logits_reference(x[::3], w), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="do not fit"):
        router_logits(x.to(device), w.to(device).half())


@pytest.mark.parametrize("T,E,H", [(1, 8, 64), (37, 20, 200), (130, 64, 128)])
def test_split_router_logits_match_fp32(T, E, H, device):
    """The tensor-core kernel's three bf16 parts of each weight sum to it exactly: fp32 accuracy from bf16 dots."""
    from moeserve.kernels.triton_ops.router_gemm import router_logits_split

    gen = torch.Generator().manual_seed(T * E + H)
    x = torch.randn(T, H, generator=gen).bfloat16()
    w = torch.randn(E, H, generator=gen) * H**-0.5
    got = router_logits_split(x.to(device), w.to(device))
    assert got.dtype == torch.float32 and got.shape == (T, E)
    exact = (x.double() @ w.double().T).float()
    torch.testing.assert_close(got.cpu(), exact, atol=2e-5, rtol=2e-5)
    # a bf16-only dot would be off by about 2^-9 relative: the test tells the split from a plain cast
    assert (router_logits_reference(x, w.bfloat16().float()) - exact).abs().max() > 1e-3
    with pytest.raises(ValueError, match="do not fit"):
        router_logits_split(x.to(device).float(), w.to(device))


def test_dispatch_by_size(monkeypatch):
    """Small gates take the CUDA-core kernel, bf16 prefills of SPLIT_MIN_TOKENS or more the tensor-core one, the
    sizes between (and fp32 x) cuBLAS."""
    from moeserve.kernels import router_gemm as dispatch
    from moeserve.kernels.triton_ops import router_gemm as ops

    calls = []
    monkeypatch.setattr(dispatch, "use_triton", lambda x: True)
    monkeypatch.setattr(ops, "router_logits", lambda x, w: calls.append(("small", x.shape[0])) or
                        router_logits_reference(x, w))
    monkeypatch.setattr(ops, "router_logits_split", lambda x, w: calls.append(("split", x.shape[0])) or
                        router_logits_reference(x, w))
    w = torch.randn(64, 2048) * 2048**-0.5
    for T, dtype in [(4, torch.bfloat16), (256, torch.bfloat16), (dispatch.SPLIT_MIN_TOKENS, torch.bfloat16),
                     (dispatch.SPLIT_MIN_TOKENS, torch.float32)]:
        x = torch.randn(T, 2048).to(dtype)
        torch.testing.assert_close(dispatch.router_logits(x, w), router_logits_reference(x, w))
    assert calls == [("small", 4), ("split", dispatch.SPLIT_MIN_TOKENS)]
