"""Expert selection on the CPU (cpu_moe_select.cpp): kernels/moe_select.py's reference after the scoring, in one call.

    cpu_select_experts(router_logits [T, E], top_k, **variant) -> (topk_ids [T, k] int64, topk_weights [T, k] fp32)

The scores are torch's softmax or sigmoid (one op, the reference's bits); the bias, group limits, top-k, gather,
renormalization and scale run in C++ per token, where the reference runs up to 15 torch ops (DeepSeek-V3's grouped
gate): about a thirteenth of a bf16 decode step of the tiny V3 at batch 1 (py-spy, one thread of the 2-core EPYC
VM, 2026-12-07). Ties between equal choices go to the lower expert id (the reference's torch.topk may pick another).
`takes(router_logits)` says whether it runs: CPU tensors, not under torch.compile. The C++ source is compiled on
first use (moeserve/kernels/build.py); where that is impossible `takes` is False and the reference runs.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from moeserve.kernels.build import load_library

SOURCE = Path(__file__).with_name("cpu_moe_select.cpp")
_GROUP_SCORE = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}


def load() -> ctypes.CDLL | None:
    """The compiled kernel library; None where it cannot be built."""
    return load_library(SOURCE, _bind, "expert selection on the CPU runs torch's ops")


def takes(router_logits: torch.Tensor) -> bool:
    return (router_logits.is_cpu and router_logits.dim() == 2 and router_logits.shape[0] > 0
            and not torch.compiler.is_compiling() and load() is not None)


def cpu_select_experts(router_logits: torch.Tensor, top_k: int, *, scoring_func: str = "softmax",
                       topk_method: str = "greedy", n_group: int = 1, topk_group: int = 1,
                       correction_bias: torch.Tensor | None = None, renormalize: bool = False,
                       routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """select_experts_reference's arguments (without append) and result; check takes() first."""
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU expert selection does not run here; check takes()")
    if scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"unknown scoring_func {scoring_func!r}")
    if topk_method not in _GROUP_SCORE:
        raise ValueError(f"unknown topk_method {topk_method!r}")
    T, E = router_logits.shape
    if not 0 < top_k <= E:
        raise ValueError(f"select_experts: top_k {top_k} outside [1, {E}]")
    logits = router_logits.float()
    scores = (logits.softmax(dim=-1) if scoring_func == "softmax" else logits.sigmoid()).contiguous()
    bias = None if correction_bias is None else correction_bias.float().contiguous()
    grouped = topk_method != "greedy" and n_group > 1
    if grouped and (E % n_group or not 0 < topk_group <= n_group):
        raise ValueError(f"select_experts: {E} experts in {n_group} groups, {topk_group} kept")
    ids = torch.empty(T, top_k, dtype=torch.int64)
    weights = torch.empty(T, top_k, dtype=torch.float32)
    lib.moeserve_moe_select(scores.data_ptr(), None if bias is None else bias.data_ptr(), T, E, top_k,
                            n_group if grouped else 1, topk_group if grouped else 1,
                            _GROUP_SCORE[topk_method] if grouped else 0, int(renormalize),
                            float(routed_scaling_factor), ids.data_ptr(), weights.data_ptr(), torch.get_num_threads())
    return ids, weights


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.moeserve_moe_select.restype = None
    lib.moeserve_moe_select.argtypes = [p, p, i64, i64, i64, i64, i64, ctypes.c_int, ctypes.c_int, ctypes.c_float, p,
                                        p, ctypes.c_int]
    return lib
