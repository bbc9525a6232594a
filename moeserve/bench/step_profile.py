"""`moeserve bench one-batch --profile`: a torch-profiler trace of decode steps and the per-part table.

The steps run as they serve (CUDA graphs replayed where they are on), so the parts are told apart by the device
kernels' names (ordered rules below; the first that matches wins): routed experts, dispatch / combine, attention,
norms, dense GEMMs (projections, shared experts, LM head), other device work; `host` is the wall time of the steps
left when the device was idle (launches, scheduling, sampling's host side). The kernels no rule names are listed
too, so a miss shows.
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
import time
from collections import defaultdict
from collections.abc import Callable

import torch

# (part, regex over the kernel name), in order. Names: Triton kernels by function name, torch's by their C++ name.
PARTS: list[tuple[str, str]] = [
    ("attention", r"_mla_decode_|_mla_rope_cache"),  # moeserve's MLA kernels (their names hold "combine", "split")
    # the bf16 and FP8 grouped GEMMs, Triton's and Gluon's, and torch's (CUTLASS) grouped GEMM
    ("experts", r"_moe_gemm_(wgmma_)?kernel|_fp8_grouped_(wgmma_)?kernel|grouped_?mm|Grouped|GroupProblemShape"),
    ("dispatch", r"_count_kernel|_place_kernel|_combine_kernel|_select_kernel|_router_logits|index_select|"
                 r"indexSelect|index_put|scatter|gather|sort|Sort|radix|topk|TopK|cumsum|scan|bitonic"),
    ("fp8 quant", r"_quantize_groups_kernel"),  # plain and SiLU-and-mul inputs: one kernel
    ("norms", r"_rms_norm_kernel|rms_norm|RowwiseMoments|norm"),
    ("attention", r"softmax|Softmax|attention|fmha|flash|cutlass_75|bmm|rotary|rope"),
    ("dense GEMMs", r"gemm|gemv|nvjet|xmma|cutlass|sm90"),
]


TOP = 4  # kernels listed under each part, by time


def classify(name: str) -> str:
    for part, pattern in PARTS:
        if re.search(pattern, name):
            return part
    return "other"


def _kernel_events(prof) -> list[tuple[str, float]]:
    """(name, device microseconds) of every device kernel (and copy) in the profile, from kineto's raw events."""
    out = []
    raw = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if raw is not None:
        for ev in raw.events():
            if ev.device_type() == torch.autograd.DeviceType.CUDA:
                out.append((ev.name(), ev.duration_ns() / 1e3))
        return out
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            out.append((e.name, e.device_time_total))
    return out


# Host calls that wait for the device (or may): where a step's host time goes when the device idles beside it.
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpyAsync",
         "aten::_local_scalar_dense", "aten::nonzero", "aten::item", "cudaHostAlloc", "cudaMalloc")


def _host_waits(prof) -> dict[str, tuple[int, float]]:
    """{name: (calls, host microseconds)} of the WAITS calls in the profile."""
    out: dict[str, list] = defaultdict(lambda: [0, 0.0])
    raw = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if raw is None:
        return {}
    for ev in raw.events():
        if ev.device_type() != torch.autograd.DeviceType.CUDA and ev.name() in WAITS:
            out[ev.name()][0] += 1
            out[ev.name()][1] += ev.duration_ns() / 1e3
    return {k: (n, us) for k, (n, us) in out.items()}


def profile_steps(step: Callable[[], None], num_steps: int, trace_path: str | None) -> dict:
    """Run `step` num_steps times under the profiler; per-part milliseconds per step, plus the trace (gzipped)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(num_steps):
            step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / num_steps
    parts: dict[str, float] = defaultdict(float)
    named: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))  # part: name: [ms, n]
    kernels = _kernel_events(prof)
    for name, us in kernels:
        part = classify(name)
        parts[part] += us / 1e3 / num_steps
        named[part][name][0] += us / 1e3 / num_steps
        named[part][name][1] += 1 / num_steps
    device_ms = sum(parts.values())
    if trace_path:
        os.makedirs(os.path.dirname(trace_path) or ".", exist_ok=True)
        raw = trace_path.removesuffix(".gz")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as f, gzip.open(raw + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        os.remove(raw)
    waits = {k: (n / num_steps, us / 1e3 / num_steps) for k, (n, us) in _host_waits(prof).items()}
    return {"step_ms": wall_ms, "device_ms": device_ms, "host_ms": max(wall_ms - device_ms, 0.0),
            "kernels_per_step": len(kernels) / num_steps, "parts_ms": dict(parts),
            "other_top": dict(sorted(((n, ms) for n, (ms, _) in named["other"].items()), key=lambda kv: -kv[1])[:8]),
            "top": {part: sorted(([n, ms, calls] for n, (ms, calls) in names.items()), key=lambda r: -r[1])[:TOP]
                    for part, names in named.items() if part != "other"},
            "host_waits": dict(sorted(waits.items(), key=lambda kv: -kv[1][1]))}


def format_table(label: str, r: dict) -> str:
    """The per-part table, one line a part, in the order of PARTS. label: e.g. 'decode step at batch 64'."""
    lines = [f"{label}: {r['step_ms']:.2f} ms wall, {r['device_ms']:.2f} ms of kernels "
             f"({r['kernels_per_step']:.0f} a step)"]
    for part in dict.fromkeys([p for p, _ in PARTS] + ["other"]):  # (a part may have several rules)
        ms = r["parts_ms"].get(part, 0.0)
        lines.append(f"  {part:12s} {ms:8.3f} ms  {100 * ms / max(r['step_ms'], 1e-9):5.1f}%")
        for name, kms, calls in r.get("top", {}).get(part, []):
            lines.append(f"      {kms:8.3f} ms x{calls:<4.0f} {name[:96]}")
    lines.append(f"  {'host':12s} {r['host_ms']:8.3f} ms  {100 * r['host_ms'] / max(r['step_ms'], 1e-9):5.1f}%"
                 "  (wall time the device was not running kernels)")
    for name, (calls, ms) in r.get("host_waits", {}).items():
        lines.append(f"    host calls: {name} x{calls:.0f} a step, {ms:.3f} ms")
    for name, ms in r["other_top"].items():
        lines.append(f"    other: {ms:.3f} ms  {name[:100]}")
    return "\n".join(lines)
