"""Tuned launch configurations of the Triton MoE kernels, read from JSON tables (the way SGLang's and vLLM's
fused-MoE configs work).

One file per (op, shape, dtype, device): configs/<op>/E=<E>,N=<N>,K=<K>,device_name=<name>,dtype=<dtype>.json,
mapping a row count M (pairs in the layout, T * top_k) to a launch configuration
{"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"}, with "TMA": true where the weights are read through
tensor descriptors and "GROUP_M": g for a grouped-M program order (or {"backend": "torch"} where torch's grouped GEMM measured faster); a launch takes the entry of the nearest M.
N is the op's output width (I for the gate/up GEMM with SiLU fused, H for the down GEMM), K its reduction size.
benchmark/kernels/tune_moe.py writes them. A shape tuned for another expert count E' (the same op, N, K, dtype and
device) lends its table, read at the same rows per expert (M * E' / E): shared-experts fusion runs the routed E
plus the shared slots, and an EP rank its E / ep local experts, through kernels tuned for the model's E. Without
any table, `default_config` picks by the rows per expert.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"
logger = logging.getLogger(__name__)
# the script that writes each op's tables (named in the warning a GPU shape without one gets)
TUNERS = {"moe_gemm": "benchmark/kernels/tune_moe.py", "moe_gemm_silu": "benchmark/kernels/tune_moe.py",
          "fp8_gemm": "benchmark/kernels/tune_fp8.py --dense",
          "fp8_grouped_gemm": "benchmark/kernels/tune_fp8.py",
          "fp8_grouped_gemm_masked": "benchmark/kernels/tune_fp8.py"}


def device_name(device: torch.device | None = None) -> str:
    """The name a table is keyed by, e.g. NVIDIA_H200 ('cpu' without CUDA)."""
    if not torch.cuda.is_available():
        return "cpu"
    return _device_name(torch.device(device).index if device is not None else None)


@functools.cache
def _device_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index).replace(" ", "_")


def config_file(op: str, E: int, N: int, K: int, dtype: torch.dtype, device: str) -> Path:
    dt = str(dtype).removeprefix("torch.")
    return CONFIG_DIR / op / f"E={E},N={N},K={K},device_name={device},dtype={dt}.json"


@functools.cache
def _load(path: str) -> dict[int, dict]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {int(m): cfg for m, cfg in json.load(f).items()}


def default_config(M: int, E: int) -> dict:
    """A configuration by the average rows per expert: small tiles that stream the weights at decode sizes,
    large ones that feed the tensor cores at prefill sizes."""
    per_expert = M / max(E, 1)
    if per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    if per_expert <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def get_config(op: str, M: int, E: int, N: int, K: int, dtype: torch.dtype,
               device: torch.device | None = None,
               default: Callable[[int, int], dict] = default_config) -> dict:
    """The tuned entry nearest M for this op and shape, else `default(M, E)` (a fresh dict each call; the FP8
    kernels pass their own default)."""
    return dict(_lookup(op, M, E, N, K, dtype, device_name(device), default))


@functools.lru_cache(maxsize=4096)  # once per (op, shape, M): eager prefill steps pay this on every layer's launch
def _lookup(op: str, M: int, E: int, N: int, K: int, dtype: torch.dtype, device: str,
            default: Callable[[int, int], dict]) -> dict:
    tuned_e = _nearest_tuned_e(op, E, N, K, dtype, device)
    if tuned_e is None:
        return default(M, E)
    table = _load(str(config_file(op, tuned_e, N, K, dtype, device)))
    m = M * tuned_e / E  # the same rows per expert
    return table[min(table, key=lambda t: abs(t - m))]


@functools.cache
def _nearest_tuned_e(op: str, E: int, N: int, K: int, dtype: torch.dtype, device: str) -> int | None:
    """E itself if tuned, else the tuned expert count of this shape nearest to it, else None."""
    if _load(str(config_file(op, E, N, K, dtype, device))):
        return E
    rest = config_file(op, E, N, K, dtype, device).name.split(",", 1)[1]
    tuned = [int(p.name.split(",", 1)[0].removeprefix("E=")) for p in (CONFIG_DIR / op).glob(f"E=*,{rest}")]
    if not tuned and device != "cpu":  # once a shape (cached): the default tile can be far off the tuned one
        logger.warning("No tuned %s table for E=%d N=%d K=%d %s on %s: the default launch configuration runs, "
                       "which can be much slower (tune it with %s)", op, E, N, K, str(dtype).removeprefix("torch."),
                       device, TUNERS.get(op, "the tuners in benchmark/kernels"))
    return min(tuned, key=lambda e: (abs(e - E), e)) if tuned else None
