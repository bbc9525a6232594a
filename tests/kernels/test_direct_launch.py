"""Direct launches of compiled Triton kernels (kernels/triton_ops/direct_launch.py): the second call of a
specialisation skips Triton's binding and must compute what the first did. GPU tests are skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from moeserve.kernels.triton_ops.direct_launch import DirectLauncher, spec_key  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_spec_key_classes():
    x = torch.zeros(8, dtype=torch.float32)
    assert spec_key(1, 32, 33, 2**40) == ((1, True), (16, True), (0, True), (16, False))
    assert spec_key(x, x[1:])[0] == (torch.float32, True) and spec_key(x[1:])[0] == (torch.float32, False)
    assert spec_key(None, 1e-6, True) == (None, 1e-6, True)


@triton.jit
def _with_default(out_ptr, value, SCALE: tl.constexpr, SHIFT: tl.constexpr = 7):
    tl.store(out_ptr + tl.arange(0, 4), value * SCALE + SHIFT + tl.arange(0, 4))


def test_arguments_fill_left_out_constexprs_from_their_defaults():
    """A constexpr with a default may be left out of a call: Triton's launch fills it, so the direct launch's
    argument list must too (a KeyError from the second call on, before)."""
    launcher = DirectLauncher(_with_default)
    assert launcher.arguments((None, 5), {"SCALE": 3}) == [None, 5, 3, 7]
    assert launcher.arguments((None, 5), {"SCALE": 3, "SHIFT": 1}) == [None, 5, 3, 1]


@cuda
@pytest.mark.gpu
def test_direct_launch_with_a_default_constexpr():
    launcher = DirectLauncher(_with_default)
    out = torch.zeros(4, dtype=torch.int32, device="cuda")
    for value in (5, 6, 9):  # the first through Triton, the others direct
        launcher((1,), out, value, SCALE=3)
        assert out.tolist() == [value * 3 + 7 + i for i in range(4)]


@cuda
@pytest.mark.gpu
def test_direct_launch_on(monkeypatch):
    from moeserve.kernels.triton_ops import direct_launch

    monkeypatch.setattr(direct_launch, "_state", {})
    assert direct_launch._enabled(), "this Triton refused the direct launch probe (see the warning)"


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("silu", [False, True])
def test_moe_gemm_direct_equals_reference(silu):
    """Three calls of one shape with fresh inputs (the first compiles or takes Triton's path, the others direct)."""
    from moeserve.kernels.moe_gemm import moe_gemm, moe_gemm_reference
    from moeserve.kernels.moe_route import moe_route
    from moeserve.kernels.rms_norm import rms_norm, rms_norm_reference
    from moeserve.kernels.triton_ops.moe_gemm import _MOE_GEMM

    E, k, H, inter, T = 64, 6, 512, 384, 37
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        ids = torch.rand(T, E, device="cuda", generator=gen).topk(k, dim=1).indices
        plan = moe_route(ids, E)
        x = torch.randn(plan.num_rows, H, device="cuda", generator=gen)
        w = torch.randn(E, 2 * inter if silu else inter, H, device="cuda", generator=gen) * H**-0.5
        got = moe_gemm(x, w, plan.offsets, plan.counts, silu)
        ref = moe_gemm_reference(x, w, plan.offsets, plan.counts, silu)
        starts, counts = plan.offsets[:-1].tolist(), plan.counts.tolist()
        valid = torch.cat([torch.arange(s, s + c) for s, c in zip(starts, counts, strict=True)])
        torch.testing.assert_close(got[valid], ref[valid], atol=1e-4, rtol=1e-4)
        r = torch.randn(T, H, device="cuda", generator=gen)
        nw = torch.rand(H, device="cuda", generator=gen)
        for a, b in zip(rms_norm(r, nw, 1e-6, r * 2), rms_norm_reference(r, nw, 1e-6, r * 2), strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert _MOE_GEMM.kernels, "no kernel was cached: the direct path never ran"
