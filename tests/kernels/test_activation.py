"""The Triton SiLU-and-mul against its torch reference (the two torch ops): the same values, as it rounds as they do."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.activation import silu_and_mul_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 32), (7, 2 * 1408), (3, 5, 2 * 40), (0, 64)])
def test_silu_and_mul_matches_reference(dtype, shape, device):
    from moeserve.kernels.triton_ops.activation import silu_and_mul

    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))) * 3).to(dtype)
    want = silu_and_mul_reference(x)
    got = silu_and_mul(x.to(device))
    assert got.shape == want.shape and got.dtype == dtype
    # bf16: Triton's interpreter (the CPU tests) truncates to bf16 where the GPU rounds to nearest, so a value
    # may sit two steps from the reference there; on the GPU the reference's roundings give its values
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=2e-2)
    torch.testing.assert_close(got.cpu(), want, **tol)
    if dtype == torch.bfloat16 and x.numel() and device == "cuda":
        same = (got.cpu() == want).float().mean().item()
        assert same > 0.97, same  # the reference's two roundings, not one rounding of the exact product


def test_strided_input_and_odd_width(device):
    from moeserve.kernels.triton_ops.activation import silu_and_mul

    x = torch.randn(6, 80, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(silu_and_mul(x.to(device)[::2]).cpu(), silu_and_mul_reference(x[::2]))
    with pytest.raises(ValueError, match="gate | up"):
        silu_and_mul(torch.randn(2, 7, device=device))
