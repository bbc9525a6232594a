"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter where there is no GPU. The variable
must be set before a kernel module is imported (triton.jit reads it at decoration time); the serving code imports
moeserve.kernels.triton_ops only for CUDA tensors, so nothing imported them before this file."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
