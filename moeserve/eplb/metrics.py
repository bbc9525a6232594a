"""How well an expert placement balances load: GPU loads, balancedness, node spans, scores over time.

A placement is phy2log [L, R] (slot r on GPU r // (R / P)) and logcnt [L, E] replicas per expert; a logical
expert's load is split evenly over its replicas, as DeepSeek's EPLB assumes. Balancedness of a layer is
mean / max GPU load: 1.0 is perfect, and 1 / balancedness is how much longer the MoE step takes than with
perfect balance (the slowest GPU sets the pace). A layer with no load scores 1.0.

All functions take torch tensors or numpy arrays and return CPU float64 (or int64) torch tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from moeserve.eplb.algorithm import rebalance_experts

__all__ = [
    "balancedness",
    "balancedness_of_loads",
    "gpu_loads",
    "group_node_span",
    "held_out_balancedness",
    "node_balancedness",
    "windowed_balancedness",
]

ArrayLike = torch.Tensor | np.ndarray
Planner = Callable[[torch.Tensor, int, int, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def gpu_loads(weight: ArrayLike, phy2log: ArrayLike, logcnt: ArrayLike | None, num_gpus: int) -> torch.Tensor:
    """Load of every GPU: weight [..., L, E] under placement phy2log [L, R] -> [..., L, P] float64.

    logcnt [L, E] replicas per expert (None: counted from phy2log). Raises ValueError if an expert with load
    has no replica (its tokens would have nowhere to go) or R is not a multiple of num_gpus.
    """
    w = _f64(weight)
    p2l = _i64(phy2log)
    if p2l.ndim != 2 or w.ndim < 2 or w.shape[-2] != p2l.shape[0]:
        raise ValueError(
            f"weight [..., L, E] {tuple(w.shape)} and phy2log [L, R] {tuple(p2l.shape)} do not match")
    num_layers, num_slots = p2l.shape
    num_experts = w.shape[-1]
    if num_gpus <= 0 or num_slots % num_gpus:
        raise ValueError(f"{num_slots} slots do not split evenly over num_gpus={num_gpus}")
    if int(p2l.min()) < 0 or int(p2l.max()) >= num_experts:
        raise ValueError(f"phy2log holds expert ids outside [0, {num_experts})")
    cnt = _replica_counts(p2l, num_experts) if logcnt is None else _i64(logcnt)
    unplaced = (cnt == 0) & (w.reshape(-1, num_layers, num_experts) > 0).any(0)
    if bool(unplaced.any()):
        layer, expert = (int(i) for i in unplaced.nonzero()[0])
        raise ValueError(f"expert {expert} of layer {layer} has load but no replica in the placement")
    per_replica = w / cnt.clamp(min=1)  # [..., L, E]
    slot = per_replica.gather(-1, p2l.expand(*w.shape[:-2], num_layers, num_slots))  # [..., L, R]
    return slot.unflatten(-1, (num_gpus, num_slots // num_gpus)).sum(-1)


def balancedness_of_loads(loads: ArrayLike) -> torch.Tensor:
    """mean / max over the last axis of loads [..., P] -> [...] float64; 1.0 where everything is zero."""
    x = _f64(loads)
    peak = x.amax(-1)
    return torch.where(peak > 0, x.mean(-1) / peak.clamp(min=1e-300), torch.ones_like(peak))


def balancedness(weight: ArrayLike, phy2log: ArrayLike, logcnt: ArrayLike | None,
                 num_gpus: int) -> torch.Tensor:
    """Per-layer mean / max GPU load of weight [..., L, E] under phy2log [L, R] -> [..., L] float64."""
    return balancedness_of_loads(gpu_loads(weight, phy2log, logcnt, num_gpus))


def node_balancedness(weight: ArrayLike, phy2log: ArrayLike, logcnt: ArrayLike | None, num_gpus: int,
                      num_nodes: int) -> torch.Tensor:
    """Per-layer mean / max node load (GPUs g // (P / num_nodes) share a node) -> [..., L] float64."""
    if num_nodes <= 0 or num_gpus % num_nodes:
        raise ValueError(f"num_gpus={num_gpus} must be a multiple of num_nodes={num_nodes}")
    loads = gpu_loads(weight, phy2log, logcnt, num_gpus)
    return balancedness_of_loads(loads.unflatten(-1, (num_nodes, num_gpus // num_nodes)).sum(-1))


def group_node_span(phy2log: ArrayLike, num_logical_experts: int, num_groups: int, num_gpus: int,
                    num_nodes: int) -> torch.Tensor:
    """How many nodes hold replicas of each expert group (experts g*E/G .. (g+1)*E/G - 1) -> [L, G] int64.

    1 everywhere for a hierarchical placement; a group spread over many nodes sends its tokens over the
    slower inter-node network.
    """
    p2l = _i64(phy2log)
    num_layers, num_slots = p2l.shape
    if num_logical_experts % num_groups or num_gpus % num_nodes or num_slots % num_gpus:
        raise ValueError(
            f"need E={num_logical_experts} divisible by num_groups={num_groups}, num_gpus={num_gpus} by "
            f"num_nodes={num_nodes} and R={num_slots} by num_gpus")
    slots_per_node = num_slots // num_nodes
    node_of_slot = torch.arange(num_slots) // slots_per_node  # [R]
    group_of_slot = p2l // (num_logical_experts // num_groups)  # [L, R]
    present = torch.zeros(num_layers, num_groups * num_nodes, dtype=torch.int64)
    present.scatter_(1, group_of_slot * num_nodes + node_of_slot, 1)
    return present.view(num_layers, num_groups, num_nodes).sum(-1)


def windowed_balancedness(logical_count: ArrayLike, window: int, phy2log: ArrayLike, num_gpus: int,
                          logcnt: ArrayLike | None = None) -> torch.Tensor:
    """Balancedness of a fixed placement over time: logical_count [T, L, E] summed over consecutive windows
    of `window` steps (a last partial window is dropped) -> [T // window, L] float64.

    A short window shows the imbalance of single steps, which is what a step's time feels; a long one shows
    the imbalance that a placement can fix.
    """
    windows = _windows(logical_count, window)  # [W, L, E]
    return balancedness(windows, phy2log, logcnt, num_gpus)


def held_out_balancedness(logical_count: ArrayLike, window: int, num_replicas: int, num_groups: int,
                          num_nodes: int, num_gpus: int,
                          planner: Planner = rebalance_experts) -> torch.Tensor:
    """Balancedness of a placement planned on window t and scored on window t + 1 -> [W - 1, L] float64.

    logical_count [T, L, E] is cut into W = T // window windows. This is what a server that rebalances
    every `window` steps sees: loads drift, so a placement is always a little stale. planner has the
    signature of rebalance_experts (default: ours).
    """
    windows = _windows(logical_count, window)  # [W, L, E]
    if windows.shape[0] < 2:
        raise ValueError(
            f"need at least two windows of {window} steps, got {_f64(logical_count).shape[0]} steps")
    scores = []
    for t in range(windows.shape[0] - 1):
        phy2log, _, logcnt = planner(windows[t], num_replicas, num_groups, num_nodes, num_gpus)
        scores.append(balancedness(windows[t + 1], phy2log, logcnt, num_gpus))
    return torch.stack(scores)


# ---------------------------------------------------------------------------------------------------------


def _windows(logical_count: ArrayLike, window: int) -> torch.Tensor:
    counts = _f64(logical_count)
    if counts.ndim != 3:
        raise ValueError(f"logical_count must be [steps, layers, experts], got shape {tuple(counts.shape)}")
    if window <= 0 or window > counts.shape[0]:
        raise ValueError(f"window={window} must be between 1 and the {counts.shape[0]} steps recorded")
    num_windows = counts.shape[0] // window
    return counts[: num_windows * window].unflatten(0, (num_windows, window)).sum(1)


def _replica_counts(p2l: torch.Tensor, num_experts: int) -> torch.Tensor:
    cnt = torch.zeros(p2l.shape[0], num_experts, dtype=torch.int64)
    return cnt.scatter_add_(1, p2l, torch.ones_like(p2l))


def _f64(x: ArrayLike) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x).to("cpu", torch.float64)


def _i64(x: ArrayLike) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x).to("cpu", torch.int64)
