"""Compiling moeserve's C++ CPU kernels on first use, and loading them with ctypes.

`load_library(source, bind, fallback)` compiles `source` with the host's C++ compiler ($CXX, else c++) for the
host CPU (-march=native) and OpenMP into $MOESERVE_CACHE/kernels (moeserve/paths.py), keyed by the source, the
compiler and the CPU, so later processes load the cached library; `bind` sets the functions' ctypes signatures.
Where no compiler or no build works it returns None and logs once why and what runs instead (`fallback`).
OpenMP resolves to the runtime torch already loaded (the same soname), so kernels share torch's threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from moeserve.paths import cache_root

logger = logging.getLogger(__name__)

_FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-march=native"], ["-O3"])
_lock = threading.Lock()
_loaded: dict[Path, ctypes.CDLL | None] = {}


def load_library(source: Path, bind: Callable[[ctypes.CDLL], ctypes.CDLL], fallback: str) -> ctypes.CDLL | None:
    """The compiled library of `source` (built on the process's first call), or None where it cannot be built."""
    with _lock:
        if source not in _loaded:
            try:
                _loaded[source] = bind(ctypes.CDLL(str(_build(source))))
            except (OSError, subprocess.SubprocessError) as e:
                logger.warning("%s unavailable, %s: %s", source.name, fallback, e)
                _loaded[source] = None
        return _loaded[source]


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


def _build(source: Path) -> Path:
    """Compile `source` into the cache (or find it there); the path of the shared library."""
    cxx, version = _compiler()
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # what the sources include
    key = hashlib.sha256(b"\0".join([source.read_bytes(), *headers, version.encode(),
                                     _cpu_id().encode()])).hexdigest()[:16]
    out_dir = cache_root() / "kernels"
    target = out_dir / f"{source.stem}-{key}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    errors = []
    for flags in _FLAG_SETS:  # OpenMP or -march=native may be missing (Apple clang): fall back, slower
        fd, tmp = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=out_dir)
        os.close(fd)
        cmd = [cxx, "-std=c++17", *flags, "-shared", "-fPIC", "-o", tmp, str(source)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode == 0:
            os.replace(tmp, target)  # atomic: processes building at once all end with one complete file
            logger.info("built %s: %s", source.name, " ".join(cmd[:-4]))
            for old in out_dir.glob(f"{source.stem}-*.so"):  # builds of older sources (a loaded one stays mapped)
                if old != target:
                    old.unlink(missing_ok=True)
            return target
        os.unlink(tmp)
        errors.append(f"{' '.join(flags)}: {proc.stderr.strip().splitlines()[-1:]}")
    raise OSError(f"compiling {source.name} failed: " + "; ".join(errors))
