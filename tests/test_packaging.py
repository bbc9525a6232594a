"""Packaging: the project depends on a torch range (so `pip install moeserve` keeps a user's CUDA torch), and its
own set-up (the Makefile behind `make serve` / `make test`) installs the local CPU build first."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_torch_is_a_range_not_a_pin():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch = [d for d in deps if re.match(r"torch\b", d)]
    assert torch == ["torch>=2.6"], torch


def test_makefile_installs_the_cpu_build_before_the_project():
    lines = (ROOT / "Makefile").read_text().splitlines()
    assert "TORCH ?= torch==2.13.0" in lines
    recipe = [line.strip() for line in lines if line.startswith("\t")]
    torch_step = next(i for i, line in enumerate(recipe) if "$(TORCH)" in line)
    project_step = next(i for i, line in enumerate(recipe) if "-e '.[test]'" in line)
    assert torch_step < project_step
