"""The compiled-kernel cache (kernels/build.py): builds of two sources (two checkouts on one machine) both stay; a
new build deletes only builds no process loaded for STALE_BUILD_S, and loading a build keeps it fresh."""

from __future__ import annotations

import os
import time

import pytest

from moeserve.kernels import build


def _source(tmp_path, value: int):
    path = tmp_path / "src" / f"v{value}" / "probe_kernel.cpp"
    path.parent.mkdir(parents=True)
    path.write_text(f'extern "C" int probe() {{ return {value}; }}\n')
    return path


def test_builds_of_other_sources_stay_until_stale(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESERVE_CACHE", str(tmp_path / "cache"))
    try:
        build._compiler()
    except OSError as e:  # no compiler here: the kernels' own fallback covers that case
        pytest.skip(f"no C++ compiler: {e}")
    isa = build.cpu_isa.current()
    one = build._build(_source(tmp_path, 1), isa)
    two = build._build(_source(tmp_path, 2), isa)
    assert one != two and one.is_file() and two.is_file()  # the second build kept the first tree's
    old = time.time() - build.STALE_BUILD_S - 60
    os.utime(one, (old, old))
    assert build._build(tmp_path / "src" / "v1" / "probe_kernel.cpp", isa) == one
    assert time.time() - one.stat().st_mtime < 60  # loading it again marked it in use
    os.utime(two, (old, old))
    three = build._build(_source(tmp_path, 3), isa)
    assert three.is_file() and one.is_file() and not two.exists()  # only the stale one went


def test_kernels_share_torchs_openmp_runtime(tmp_path, monkeypatch):
    """A kernel with an OpenMP parallel region links torch's own libgomp (one pool of threads for torch's ops and
    the kernels): after loading it, the process maps one libgomp, and the region's threads are that runtime's (its
    thread count follows torch.set_num_threads through omp_set_num_threads)."""
    import ctypes

    import torch

    monkeypatch.setenv("MOESERVE_CACHE", str(tmp_path / "cache"))
    try:
        build._compiler()
    except OSError as e:
        pytest.skip(f"no C++ compiler: {e}")
    if build.torch_openmp() is None:
        pytest.skip("torch here has no GNU OpenMP runtime of its own")
    path = tmp_path / "src" / "omp_probe.cpp"
    path.parent.mkdir(parents=True)
    path.write_text('#include <omp.h>\nextern "C" int probe() { int n = 0;\n#pragma omp parallel\n'
                    '{\n#pragma omp single\nn = omp_get_num_threads();\n}\nreturn n; }\n')
    lib = ctypes.CDLL(str(build._build(path, build.cpu_isa.current())))
    gomps = {line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line}
    assert gomps == {build.torch_openmp()}
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert lib.probe() == 1  # torch's setting reached the kernel's runtime: the same one
    finally:
        torch.set_num_threads(before)
