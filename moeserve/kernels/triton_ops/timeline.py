"""When and where a Triton program ran, for scripts that draw a kernel's timeline (scripts/gpu/decode_gemm_timeline.py).

A kernel built with its TIMELINE flag on calls `program_start` first and `program_end` last: each program writes
[start ns, end ns, SM, tag] (int64) at its index of a [programs, 4] buffer. The clock is the GPU's global timer
(%globaltimer, the same across SMs), so the programs of consecutive kernels line up. GPU only (inline PTX; the
interpreter has none). With the flag off (the default) the kernels compile without any of it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def program_start():
    """The global timer now (ns, int64)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def program_end(times_ptr, pid, start, tag):
    """Row pid of the [programs, 4] buffer: start, the timer now, this program's SM, tag (e.g. its expert)."""
    end = program_start()
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)
    row = times_ptr + pid.to(tl.int64) * 4
    tl.store(row, start)
    tl.store(row + 1, end)
    tl.store(row + 2, sm.to(tl.int64))
    tl.store(row + 3, tag)
