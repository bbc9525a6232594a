"""Which instruction set moeserve's C++ CPU kernels are compiled for (--cpu-isa), picked once per process.

    amx         AMX tiles (bf16) and AVX-512 BF16: the bf16 experts on tiles or as bf16 dot products, bf16 dot
                products in MLA decode and the skinny GEMMs
    avx512bf16  AVX-512 BF16 without AMX (AMD Zen 4 and later, Intel Cooper Lake): the same bf16 dot products
    avx512      AVX-512 (F, BW, VL, DQ)
    avx2     AVX2 and FMA
    native   not x86: -march=native, the portable code only

Every kernel is one source with #if guards on the compiler's ISA macros (__AMX_TILE__, __AVX512BF16__, ...);
kernels/build.py compiles it once per ISA with `compile_flags(isa)`. `select(requested)` checks the request
against the CPU's features (/proc/cpuinfo) and logs the pick once; `current()` is it (auto where nothing was
selected). Tests force a path with `select("avx2")` etc. and skip a path the CPU lacks (`supported()`).
"""

from __future__ import annotations

import functools
import logging
import platform
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ISAS = ("amx", "avx512bf16", "avx512", "avx2")  # best first
CHOICES = ("auto", *ISAS)  # --cpu-isa
# What each ISA needs from the CPU (cpuinfo flag names), and how it is compiled: a -march level of that ISA
# without the host's extras, so that a forced avx2 build holds no AVX-512 instruction; tuned for the host.
_NEEDS = {
    "amx": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_tile", "amx_bf16"),
    "avx512bf16": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx2": ("avx2", "fma", "f16c"),
}
_FLAGS = {
    "amx": ["-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mtune=native"],
    "avx512bf16": ["-march=x86-64-v4", "-mavx512bf16", "-mtune=native"],
    "avx512": ["-march=x86-64-v4", "-mtune=native"],
    "avx2": ["-march=x86-64-v3", "-mtune=native"],
    "native": ["-march=native"],
}
_selected: str | None = None


@functools.cache
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty where unreadable."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def supported() -> tuple[str, ...]:
    """The ISAs this CPU runs, best first (("native",) off x86)."""
    if not is_x86():
        return ("native",)
    have = cpu_features()
    return tuple(isa for isa in ISAS if all(f in have for f in _NEEDS[isa]))


def native_bf16() -> bool:
    """Whether the CPU has bf16 dot products (AVX-512 BF16 or AMX), which torch's bf16 GEMMs (oneDNN) run on
    whatever ISA the kernels here are built for: without them a bf16 GEMM runs several times slower."""
    have = cpu_features()
    return "avx512_bf16" in have or "amx_bf16" in have


def missing(isa: str) -> tuple[str, ...]:
    """The CPU features `isa` needs that this CPU lacks."""
    return tuple(f for f in _NEEDS.get(isa, ()) if f not in cpu_features())


def check(requested: str) -> None:
    """Raise ValueError where --cpu-isa names an ISA this CPU lacks."""
    if requested not in CHOICES:
        raise ValueError(f"--cpu-isa {requested}: choose one of {', '.join(CHOICES)}")
    if requested != "auto" and requested not in supported():
        why = f"lacks {', '.join(missing(requested))}" if is_x86() else f"is {platform.machine()}, not x86"
        raise ValueError(f"--cpu-isa {requested}: this CPU {why}; it runs {', '.join(supported()) or 'none of them'}"
                         f" (--cpu-isa auto picks the best)")


def select(requested: str = "auto") -> str:
    """Pick the kernels' ISA for this process (auto: the best the CPU has); log it when it changes."""
    global _selected
    check(requested)
    isa = supported()[0] if requested == "auto" and supported() else requested
    if requested == "auto" and not supported():
        isa = "native"  # an x86 CPU older than AVX2: the portable code
    if isa != _selected:
        logger.info("CPU kernels: %s (%s; torch's own: %s)", _label(isa), "forced" if requested != "auto" else "auto",
                    torch.backends.cpu.get_cpu_capability())
    _selected = isa
    return isa


def current() -> str:
    """The ISA the kernels are built for: the selected one, else auto's pick."""
    return _selected or select("auto")


def compile_flags(isa: str) -> list[str]:
    return list(_FLAGS[isa])


def _label(isa: str) -> str:
    return {"amx": "amx-bf16 (AMX tiles, AVX-512 BF16)", "avx512bf16": "avx512-bf16 (AVX-512 BF16, no AMX)",
            "avx512": "avx512", "avx2": "avx2 + fma",
            "native": f"-march=native ({platform.machine()})"}[isa]
