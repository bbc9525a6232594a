"""Host time of one launch of each Triton kernel against the torch ops it replaces, at a tiny decode shape (the
device is never the bottleneck here: this is what an eager, non-graph step pays per call), each Triton kernel both
through `kernel[grid]` and through the direct launch of its compiled handle (kernels/triton_ops/direct_launch.py).
Run on the GPU machine."""

import time

import torch

from moeserve.kernels.moe_combine import moe_combine, moe_combine_reference
from moeserve.kernels.moe_gemm import moe_gemm, moe_gemm_reference
from moeserve.kernels.moe_route import moe_route, moe_route_reference
from moeserve.kernels.rms_norm import rms_norm, rms_norm_reference
from moeserve.kernels.triton_ops import direct_launch
from moeserve.kernels.triton_ops import moe_combine as tc
from moeserve.kernels.triton_ops import moe_gemm as tg
from moeserve.kernels.triton_ops import moe_route as tr
from moeserve.kernels.triton_ops import rms_norm as tn


def host_us(fn, n: int = 2000) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e6


E, k, H, inter, T = 64, 6, 2048, 1408, 4
ids = torch.rand(T, E, device="cuda").topk(k, dim=1).indices
plan = moe_route(ids, E)
x = torch.randn(T * k, H, device="cuda", dtype=torch.bfloat16)
w13 = torch.randn(E, 2 * inter, H, device="cuda", dtype=torch.bfloat16)
xs = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
nw = torch.ones(H, device="cuda", dtype=torch.bfloat16)
wts = torch.rand(T, k, device="cuda")
rows = plan.dest.view(T, k)
cases = {
    "moe_route": (lambda: moe_route(ids, E), lambda: moe_route_reference(ids, E)),
    "moe_gemm silu": (lambda: moe_gemm(x, w13, plan.offsets, plan.counts, True),
                      lambda: moe_gemm_reference(x, w13, plan.offsets, plan.counts, True)),
    "moe_combine": (lambda: moe_combine(x, rows, wts), lambda: moe_combine_reference(x, rows, wts)),
    "rms_norm + residual": (lambda: rms_norm(xs, nw, 1e-6, xs), lambda: rms_norm_reference(xs, nw, 1e-6, xs)),
}
LAUNCHERS = (tg._MOE_GEMM, tc._COMBINE, tr._COUNT, tr._PLACE, tn._RMS_NORM)


def direct(on: bool) -> None:
    direct_launch._state["on"] = on
    for launcher in LAUNCHERS:
        launcher.kernels.clear()


for name, (fast, ref) in cases.items():
    direct(False)
    jit_us = host_us(fast)
    direct(True)
    print(f"{name:22s} triton kernel[grid] {jit_us:7.1f} | direct {host_us(fast):7.1f} us/call on the host | "
          f"torch {host_us(ref):7.1f} us/call")
