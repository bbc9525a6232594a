"""Compiling a Gluon kernel (or a plain Triton one) for an sm_90 GPU on a machine without one (Gluon has no
interpreter; the interpreter does not compile), and reading ptxas's report of the result: what the CPU tests of the
Gluon kernels check."""

from __future__ import annotations

import subprocess
from pathlib import Path


def _language_state() -> list[tuple[object, dict]]:
    """What Triton's interpreter patches: triton.language's modules and the classes it rebinds methods of."""
    try:
        import triton.language as tl
    except ImportError:  # (no Triton: the Gluon tests skip)
        return []
    objs = (tl, tl.core, tl.math, tl.tensor, tl.dtype, tl.condition, tl.core.tensor_descriptor_base)
    return [(o, dict(vars(o))) for o in objs]


_CLEAN = _language_state()  # at import (collection): before any test has run a kernel under the interpreter


def undo_interpreter_patches() -> None:
    """Put triton.language back as imported. Under TRITON_INTERPRET=1 the interpreter rebinds the language's
    functions to its own semantics while it runs a kernel, and a device function's call (a @triton.jit helper or the
    standard library's tl.max) rebinds them again without restoring them (Triton 3.9): a real compile after that
    ran the interpreter's semantics on IR values and failed, once the on-disk cache did not already hold the result."""
    for obj, clean in _CLEAN:
        now = vars(obj)
        for name in [n for n in now if n not in clean]:
            delattr(obj, name)
        for name, value in clean.items():
            if now.get(name) is not value:
                setattr(obj, name, value)


def _hopper_build(kern, source, sig: dict[str, str], consts: dict, options: dict, **attrs):
    """kern's source (Gluon's or Triton's AST source class) compiled for sm_90: sig the non-constant arguments'
    types (the others i32), consts the constexprs."""
    import triton
    from triton.backends.compiler import GPUTarget

    signature = dict.fromkeys(kern.arg_names, "i32") | sig | dict.fromkeys(consts, "constexpr")
    undo_interpreter_patches()
    src = source(fn=kern, signature=signature,
                 constexprs={(kern.arg_names.index(k),): v for k, v in consts.items()}, **attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_for_hopper(kern, sig: dict[str, str], consts: dict, divisible: tuple[str, ...] = ()):
    """kern (Gluon) compiled for sm_90 with Triton's own compiler: sig the non-constant arguments' types (the others
    i32), consts the constexprs, divisible the arguments Triton's launcher would see divisible by 16 (pointers
    16-byte aligned, strides and sizes)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    return _hopper_build(kern, GluonASTSource, sig, consts, dict(num_warps=consts["num_warps"]),
                         attrs={(kern.arg_names.index(k),): [["tt.divisibility", 16]] for k in divisible})


def compile_triton_for_hopper(kern, sig: dict[str, str], consts: dict, options: dict):
    """A plain @triton.jit kernel compiled for sm_90 the same way (options: num_warps, num_stages)."""
    from triton.compiler import ASTSource

    return _hopper_build(kern, ASTSource, sig, consts, options)


def ptxas_report(ptx: str, tmp_path: Path) -> str:
    """ptxas -v's report of the PTX built for sm_90a (registers, spills, warnings), with the ptxas shipped with
    Triton (the newer one first)."""
    import triton

    (tmp_path / "k.ptx").write_text(ptx)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    ptxas = next(p for p in (tools / "ptxas-blackwell", tools / "ptxas") if p.exists())
    return subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.o")],
                          capture_output=True, text=True, check=True).stderr
