"""The Triton RMSNorm (with and without the residual add) against its torch reference."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.rms_norm import rms_norm_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 8), (5, 40), (3, 2, 100)])  # one row; D not a power of two; 3-d input
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, shape, with_residual, device):
    from moeserve.kernels.triton_ops.rms_norm import rms_norm

    gen = torch.Generator().manual_seed(shape[-1] + with_residual)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    res = torch.randn(shape, generator=gen).to(dtype) if with_residual else None
    ref = rms_norm_reference(x, w, 1e-6, res)
    got = rms_norm(x.to(device), w.to(device), 1e-6, None if res is None else res.to(device))
    tol = 1e-5 if dtype == torch.float32 else 4e-2  # bf16: one rounding step of values up to ~8 apart
    for g, r in zip(got if with_residual else (got,), ref if with_residual else (ref,), strict=True):
        assert g.dtype == dtype and g.shape == r.shape
        torch.testing.assert_close(g.cpu().float(), r.float(), atol=tol, rtol=tol)
