"""Compiling moeserve's C++ CPU kernels on first use, and loading them with ctypes.

`load_library(source, bind, fallback)` compiles `source` with the host's C++ compiler ($CXX, else c++) for the
process's ISA (kernels/cpu_isa.py: amx, avx512, avx2; -march=native off x86) and OpenMP into
$MOESERVE_CACHE/kernels (moeserve/paths.py), keyed by the source, the ISA, the compiler and the CPU, so later
processes load the cached library; `bind` sets the functions' ctypes signatures.
Where no compiler or no build works it returns None and logs once why and what runs instead (`fallback`).
OpenMP resolves to the runtime torch already loaded (the same soname), so kernels share torch's threads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from moeserve.kernels import cpu_isa
from moeserve.paths import cache_root, touch

logger = logging.getLogger(__name__)

_lock = threading.Lock()
# A cached build of another source (another checkout, an older version) is deleted by a new build once no process
# loaded it for this long: several trees on one machine keep their builds rather than delete each other's.
STALE_BUILD_S = 14 * 24 * 3600
_loaded: dict[tuple[Path, str], ctypes.CDLL | None] = {}
_MISSING = object()


def _flag_sets(isa: str) -> list[list[str]]:
    """Compile flags to try in order: OpenMP or the -march flags may be missing (Apple clang): fall back, slower.
    An x86 ISA build never falls back below its ISA (it would run other code than the one asked for)."""
    sets = [["-O3", *cpu_isa.compile_flags(isa), "-fopenmp"], ["-O3", *cpu_isa.compile_flags(isa)]]
    return [*sets, ["-O3"]] if isa == "native" else sets


def load_library(source: Path, bind: Callable[[ctypes.CDLL], ctypes.CDLL], fallback: str) -> ctypes.CDLL | None:
    """The compiled library of `source` for the process's ISA (built on its first call), or None where it cannot
    be built."""
    isa = cpu_isa.current()
    lib = _loaded.get((source, isa), _MISSING)  # asked on every kernel call: no lock once loaded
    if lib is not _MISSING:
        return lib
    with _lock:
        if (source, isa) not in _loaded:
            try:
                _loaded[source, isa] = bind(ctypes.CDLL(str(_build(source, isa))))
            except (OSError, subprocess.SubprocessError) as e:
                logger.warning("%s (%s) unavailable, %s: %s", source.name, isa, fallback, e)
                _loaded[source, isa] = None
        return _loaded[source, isa]


def _compiler() -> tuple[str, str]:
    """($CXX or c++, its --version) or OSError."""
    cxx = os.environ.get("CXX", "c++")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    except FileNotFoundError as e:
        raise OSError(f"no C++ compiler ({cxx}); set CXX") from e
    return cxx, version


def _cpu_id() -> str:
    """What -march=native depends on: the machine and, on Linux, the CPU's model and feature flags."""
    parts = [platform.machine()]
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features")):
                parts.append(line)
                if len(parts) == 3:
                    break
    except OSError:
        pass
    return "\n".join(parts)


def _delete_stale(builds, keep: Path) -> None:
    """Delete the builds (other than keep) no process loaded for STALE_BUILD_S (a loaded one stays mapped)."""
    now = time.time()
    for old in builds:
        try:
            if old != keep and now - old.stat().st_mtime > STALE_BUILD_S:
                old.unlink()
        except FileNotFoundError:
            pass


@functools.cache
def torch_openmp() -> str | None:
    """The GNU OpenMP runtime torch loaded into this process (its own copy, whatever its file name), or None.

    The kernels link against it: with the system's libgomp they would run a second pool of threads beside torch's,
    and the two pools' threads, each spinning a while after its parallel regions, fight for the cores whenever
    torch's ops and the kernels take turns (a decode step: many times). One pool serves both."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    found = {line.split()[-1] for line in maps.splitlines() if re.search(r"/libgomp[^/]*\.so", line)}
    return sorted(found)[0] if len(found) == 1 else None


def _build(source: Path, isa: str) -> Path:
    """Compile `source` for `isa` into the cache (or find it there); the path of the shared library."""
    cxx, version = _compiler()
    openmp = torch_openmp()
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # what the sources include
    key = hashlib.sha256(b"\0".join([source.read_bytes(), *headers, version.encode(), _cpu_id().encode(),
                                     " ".join(cpu_isa.compile_flags(isa)).encode(),
                                     (openmp or "").encode()])).hexdigest()[:16]
    out_dir = cache_root() / "kernels"
    target = out_dir / f"{source.stem}-{isa}-{key}.so"
    if target.is_file():
        touch(target)  # in use: not stale for other builds
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    errors = []
    for flags in _flag_sets(isa):
        fd, tmp = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=out_dir)
        os.close(fd)
        cmd = [cxx, "-std=c++17", *flags, "-shared", "-fPIC", "-o", tmp, str(source)]
        if openmp is not None and "-fopenmp" in flags:  # torch's runtime first: the system's -lgomp then unneeded
            cmd += ["-Wl,--as-needed", openmp, f"-Wl,-rpath,{Path(openmp).parent}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode == 0:
            os.replace(tmp, target)  # atomic: processes building at once all end with one complete file
            logger.info("built %s: %s (OpenMP: %s)", source.name, " ".join(cmd[:cmd.index("-o")]),
                        openmp or "the compiler's")
            _delete_stale(out_dir.glob(f"{source.stem}-{isa}-*.so"), keep=target)
            return target
        os.unlink(tmp)
        errors.append(f"{' '.join(flags)}: {proc.stderr.strip().splitlines()[-1:]}")
    raise OSError(f"compiling {source.name} failed: " + "; ".join(errors))
