"""Compiling a Gluon kernel for an sm_90 GPU on a machine without one (Gluon has no interpreter), and reading
ptxas's report of the result: what the CPU tests of the Gluon kernels check."""

from __future__ import annotations

import subprocess
from pathlib import Path


def compile_for_hopper(kern, sig: dict[str, str], consts: dict, divisible: tuple[str, ...] = ()):
    """kern compiled for sm_90 with Triton's own compiler: sig the non-constant arguments' types (the others i32),
    consts the constexprs, divisible the arguments Triton's launcher would see divisible by 16 (pointers 16-byte
    aligned, strides and sizes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = dict.fromkeys(kern.arg_names, "i32") | sig | dict.fromkeys(consts, "constexpr")
    src = GluonASTSource(fn=kern, signature=signature,
                         constexprs={(kern.arg_names.index(k),): v for k, v in consts.items()},
                         attrs={(kern.arg_names.index(k),): [["tt.divisibility", 16]] for k in divisible})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=consts["num_warps"]))


def ptxas_report(ptx: str, tmp_path: Path) -> str:
    """ptxas -v's report of the PTX built for sm_90a (registers, spills, warnings), with the ptxas shipped with
    Triton (the newer one first)."""
    import triton

    (tmp_path / "k.ptx").write_text(ptx)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    ptxas = next(p for p in (tools / "ptxas-blackwell", tools / "ptxas") if p.exists())
    return subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.o")],
                          capture_output=True, text=True, check=True).stderr
