"""The Triton RMSNorm (with and without the residual add) against its torch reference."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.rms_norm import rms_norm, rms_norm_reference


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


@pytest.mark.parametrize("shape", [(1, 256), (3, 576), (64, 1536), (2, 3, 7168), (4, 100)])
def test_cpu_reference_in_bf16_rounds_as_the_fp32_upcast(shape):
    """On the CPU the reference normalizes bf16 directly (no dtype copies): the same bits as normalizing its fp32
    upcast and rounding, rows of very different scales."""
    gen = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=gen) * torch.rand(*shape[:-1], 1, generator=gen) * 20).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(torch.bfloat16)
    upcast = w * torch.nn.functional.rms_norm(x.float(), (shape[-1],), eps=1e-6).to(torch.bfloat16)
    assert torch.equal(rms_norm_reference(x, w, 1e-6), upcast)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 256), (3, 576), (64, 1536), (2, 3, 7168), (4, 100), (1, 5)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_cpu_kernel_matches_reference(shape, with_residual, dtype):
    """The C++ RMSNorm (kernels/cpu_rms_norm.py, what rms_norm runs for bf16 and float32 on the CPU) against the
    reference: h = x + residual bit for bit; y differs only where the sum of squares, summed in another order, moves
    x / rms: in bf16 across a rounding boundary (under 1% of the values), in float32 by a few steps. Widths that are
    not multiples of the vectors."""
    from moeserve.kernels import cpu_rms_norm

    gen = torch.Generator().manual_seed(shape[-1] * 2 + with_residual)
    x = (torch.randn(shape, generator=gen) * torch.rand(*shape[:-1], 1, generator=gen) * 20).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    res = torch.randn(shape, generator=gen).to(dtype) if with_residual else None
    if cpu_rms_norm.load() is None:
        pytest.skip("no C++ compiler: the CPU kernels cannot build")
    assert cpu_rms_norm.takes(x, w, res)
    got = rms_norm(x, w, 1e-6, res)
    ref = rms_norm_reference(x, w, 1e-6, res)
    y, yr = (got[0], ref[0]) if with_residual else (got, ref)
    if with_residual:
        assert torch.equal(got[1], ref[1])
    assert y.dtype == dtype and y.shape == yr.shape
    if dtype is torch.float32:
        torch.testing.assert_close(y, yr, rtol=4e-7, atol=1e-6)
        return
    differ = y != yr
    assert differ.float().mean() < 0.01
    # n = x / rms moves by one bf16 step at most; y = weight * n by that times |weight| (up to ~1.3 here) plus its
    # own rounding: at most two steps of y (one step at magnitude v is v * 2^-7 to v * 2^-8)
    step = torch.maximum(y.float().abs(), yr.float().abs()) * 2**-7
    assert ((y.float() - yr.float()).abs() <= 2 * step).all()


@pytest.mark.parametrize("shape", [(1, 128), (6, 300), (2, 3, 512)])  # one row; a partial group; 3-d input
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quant_matches_norm_then_quantizer(shape, with_residual, device):
    """The norm that quantizes its output: the same bits as the Triton norm then the Triton quantizer (the values
    rounded to bf16 first in both), and close to the torch reference (the norm's last bits may differ; under the
    interpreter its e4m3 conversion drops some round-up carries, see tests/kernels/test_fp8_kernels.py)."""
    from moeserve.kernels.rms_norm import rms_norm_quant_reference
    from moeserve.kernels.triton_ops.fp8_quant import quantize_activations
    from moeserve.kernels.triton_ops.rms_norm import rms_norm, rms_norm_quant

    gen = torch.Generator().manual_seed(shape[-1] * 2 + with_residual)
    x = (torch.randn(shape, generator=gen) * 3).to(torch.bfloat16)
    w = (1 + 0.3 * torch.randn(shape[-1], generator=gen)).to(torch.bfloat16)
    res = torch.randn(shape, generator=gen).to(torch.bfloat16) if with_residual else None
    dev = (x.to(device), w.to(device), 1e-6, None if res is None else res.to(device))
    q, s, h = rms_norm_quant(*dev)
    groups = -(-shape[-1] // 128)
    assert q.shape == shape and q.dtype == torch.float8_e4m3fn and s.shape == (*shape[:-1], groups)
    assert s.reshape(-1, groups).stride() == (1, q.numel() // shape[-1])  # M-major, as the FP8 GEMMs read them
    plain = rms_norm(*dev)
    y = plain[0] if with_residual else plain
    assert torch.equal(h, plain[1]) if with_residual else h is None
    uq, us = quantize_activations(y)
    assert torch.equal(q.view(torch.uint8), uq.view(torch.uint8)) and torch.equal(s, us)
    ref = rms_norm_quant_reference(x, w, 1e-6, res)
    rq, rs = ref[0] if with_residual else ref
    torch.testing.assert_close(s.cpu(), rs, rtol=2e-2, atol=0)  # a bf16 step of the group's largest value
    assert (q.cpu().float() == rq.float()).float().mean() > (0.8 if device == "cpu" else 0.9)
