"""Launch a compiled Triton kernel without Triton's per-call binding, once the same specialisation has compiled.

`kernel[grid](...)` re-derives on every call what it specialises on (each argument's type, pointer alignment and
integer divisibility), hashes that into its cache key, checks the globals the kernel read, and only then launches.
An eager prefill step makes ~5 such launches per MoE layer, so that Python costs host time the GPU waits on.
`DirectLauncher` keys its own cache by what the caller says the kernel specialises on (`spec_key` below, plus the
caller's configuration) and, on a hit, calls the CompiledKernel's launcher with the same arguments Triton would.

Triton's launcher ABI is internal: the first direct launch of each process is checked against a probe kernel
(`_probe`): if this Triton's CompiledKernel does not take the arguments in that form, direct launches are switched
off (logged once) and every call goes through `kernel[grid]`. MOESERVE_TRITON_DIRECT_LAUNCH=0 switches them off too.
Under TRITON_INTERPRET=1 (the CPU tests) the interpreter runs every call.
"""

from __future__ import annotations

import inspect
import logging
import os

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)
_state: dict[str, bool] = {}


def spec_key(*args: object) -> tuple:
    """What Triton specialises a launch on, for the arguments that are not constexpr: a tensor's dtype and
    16-byte alignment, an int's class (1, divisible by 16, other; 32 or 64 bits), None; anything else by value."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append((a.dtype, a.data_ptr() & 15 == 0))
        elif isinstance(a, bool) or not isinstance(a, int):
            out.append(a)
        else:
            out.append((1 if a == 1 else 16 if a % 16 == 0 else 0, -2**31 <= a < 2**31))
    return tuple(out)


class DirectLauncher:
    """Wraps one @triton.jit function: `launcher(grid, *args, **constexprs_and_options)`, args the kernel's
    leading non-constexpr parameters in order, the constexprs and options by keyword."""

    def __init__(self, fn: triton.runtime.JITFunction):
        self.fn = fn
        self.kernels: dict[tuple, object] = {}
        self.names = list(fn.arg_names)
        # constexprs the caller may leave out: Triton's own launch fills them from the signature, so must a direct one
        self.defaults = {name: p.default for name, p in inspect.signature(fn.fn).parameters.items()
                         if p.default is not inspect.Parameter.empty}
        self.options = ("num_warps", "num_stages", "num_ctas", "maxnreg")

    def __call__(self, grid: tuple[int, ...], *args: object, **meta: object) -> None:
        key = (spec_key(*args), *meta.values())
        kernel = self.kernels.get(key)
        if kernel is None:
            kernel = self.fn[grid](*args, **meta)
            if kernel is not None and _enabled():
                self.kernels[key] = kernel
            return
        full = self.arguments(args, meta)
        g = (*grid, 1, 1)
        kernel.run(g[0], g[1], g[2], _stream(), kernel.function,
                   kernel.packed_metadata, None, _hooks.launch_enter_hook, _hooks.launch_exit_hook, *full)

    def arguments(self, args: tuple, meta: dict) -> list:
        """The kernel's parameters in order: args, then each later one from meta or its default."""
        return [*args, *(meta[n] if n in meta else self.defaults[n] for n in self.names[len(args):])]


class _NoHooks:
    launch_enter_hook = None
    launch_exit_hook = None


_hooks = getattr(getattr(triton, "knobs", None), "runtime", _NoHooks)


def _stream() -> int:
    return torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())


def _enabled() -> bool:
    """Decided once, on an eager call (the probe reads its result back, which a graph capture cannot)."""
    if "on" not in _state:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return False
        _state["on"] = (os.environ.get("MOESERVE_TRITON_DIRECT_LAUNCH", "1") != "0"
                        and os.environ.get("TRITON_INTERPRET", "0") != "1" and _probe())
    return _state["on"]


@triton.jit
def _probe_kernel(out_ptr, value, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, value * SCALE + offs, mask=offs < n)


def _probe() -> bool:
    """One launch through Triton, one direct: the direct one must write what Triton's did."""
    if not torch.cuda.is_available():
        return False
    out = torch.zeros(40, dtype=torch.int32, device="cuda")
    try:
        kernel = _probe_kernel[(3,)](out, 5, 40, SCALE=3, BLOCK=16)
        first = out.clone()
        out.zero_()
        kernel.run(3, 1, 1, _stream(), kernel.function, kernel.packed_metadata, None,
                   _hooks.launch_enter_hook, _hooks.launch_exit_hook, out, 5, 40, 3, 16)
        ok = bool((out == first).all()) and int(first[39]) == 5 * 3 + 39
    except (TypeError, AttributeError, RuntimeError, ValueError) as e:
        logger.warning("Triton direct launches are off: this Triton's launcher refused the probe (%s)", e)
        return False
    if not ok:
        logger.warning("Triton direct launches are off: the probe's direct launch wrote other values")
    return ok
