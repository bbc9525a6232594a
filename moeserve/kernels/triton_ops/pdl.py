"""Programmatic dependent launch (Hopper and later) for a GEMM that streams weights after a short kernel.

A kernel launched with `launch_pdl=True` may start while the kernel before it in the stream still runs, once every
program of that kernel has called `gdc_launch_dependents` (or ended); `gdc_wait` then blocks until that kernel has
finished and its writes are visible. A decode GEMM's weights do not depend on the kernel before it (the
activations' quantizer), so its programs ask L2 for their first weight blocks before they wait: the weight stream
starts while the quantizer runs instead of after it.

What a program may read before its wait: only what was written before the kernel before it started. The caller
guarantees that by launching the kernel before it (the quantizer) without PDL, so everything earlier has finished
when the GEMM starts; the quantizer's own outputs are read after the wait.

A tuned table's entry asks for it ("PDL": K blocks to prefetch); MOESERVE_PDL=0 launches every such entry without
it (for A/B runs and debugging).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:  # Triton's grid dependency control (3.4 and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - an older Triton: no PDL launches
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def prefetch_l2(ptrs, nbytes):
    """Ask L2 for nbytes (a multiple of 16) from each 16-byte aligned address in ptrs (a bulk prefetch a row: no
    registers, nothing waits for it)."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [ptrs, nbytes + tl.zeros_like(ptrs.to(tl.int64)).to(tl.int32)], dtype=tl.int32,
                              is_pure=False, pack=1)


def usable(t: torch.Tensor) -> bool:
    """PDL launches and the bulk prefetch: a Hopper-class GPU, compiled kernels (not Triton's interpreter)."""
    return t.is_cuda and _usable_on(t.device.index)


@functools.cache
def _usable_on(index: int | None) -> bool:
    return (gdc_wait is not None and torch.cuda.get_device_capability(index)[0] >= 9
            and os.environ.get("TRITON_INTERPRET", "0") != "1" and os.environ.get("MOESERVE_PDL", "1") != "0")
