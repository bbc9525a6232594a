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
