"""Expert placement for EPLB: how many replicas each expert gets and which GPU slot holds each.

Same contract as DeepSeek's reference EPLB (github.com/deepseek-ai/EPLB, `eplb.py`), so the two can be
compared on the same inputs: slot r lives on GPU r // (R / P); with num_groups % num_nodes == 0 the
hierarchical policy packs expert groups to nodes and keeps every replica of a group's experts on that node,
otherwise the global policy treats all GPUs as one node.

How it places (per layer, several candidates, the best one kept):
  - "ours": greedy replica counts capped at one replica per GPU, duplicate-avoiding LPT, then local search;
    in the hierarchical policy also with groups packed to nodes by LPT plus local search;
  - "reference": the reference's own steps (float32 greedy replication, cardinality-constrained LPT, same
    tie-breaks), then local search. Local search never raises the objective, so the result is never worse
    than the reference.
Local search swaps a replica on the most loaded GPU with a replica elsewhere while that lowers the objective
(the max GPU load; with a time axis the weighted sum over steps of the per-step max), then removes two
replicas of one expert on one GPU where a swap can do so without raising the objective. Swaps keep the
number of slots per GPU fixed. A placement without such duplicates is kept wherever it is at least as good
as the reference's; elsewhere duplicates are allowed (they can pack better, and the reference uses them
often). Everything is vectorized over layers (numpy); loops run over items or swaps.
"""

from __future__ import annotations

import numpy as np
import torch

from moeserve.eplb.local_search import REL_TOL as _REL_TOL
from moeserve.eplb.local_search import local_search

__all__ = [
    "is_hierarchical",
    "logical_to_physical_map",
    "rebalance_experts",
    "rebalance_experts_over_window",
    "rebalance_experts_reference",
]


# ---------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------


def rebalance_experts(weight: torch.Tensor | np.ndarray, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int, *, max_slots_per_gpu: int | None = None,
                      avoid_duplicates: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Place num_replicas expert replicas on num_gpus GPUs so that the most loaded GPU is as light as possible.

    weight: [L, E] load per logical expert (token counts), any dtype, any device, or a numpy array.
    num_replicas: R physical slots per layer, a multiple of num_gpus and at least E.
    num_groups, num_nodes: hierarchical policy if num_groups % num_nodes == 0, global otherwise.
    max_slots_per_gpu: if given, R / num_gpus may not exceed it (expert memory on one GPU).
    avoid_duplicates: keep two replicas of one expert off one GPU unless only that matches the reference's
      max load (the reference itself often doubles up); False: lowest max load, duplicates or not.

    Returns (CPU int64):
      phy2log [L, R]: logical expert held by each slot; slot r is on GPU r // (R / num_gpus).
      log2phy [L, E, X]: the slots of each logical expert, ascending, padded with -1 (X = max replica count).
      logcnt [L, E]: replicas per logical expert, >= 1, summing to R.
    """
    w = _as_float64(weight)
    if w.ndim != 2:
        raise ValueError(
            f"weight must be [layers, experts], got shape {tuple(w.shape)}; for a time axis [steps, layers, "
            "experts] call rebalance_experts_over_window, or sum over steps first")
    w32 = _as_float32(weight)
    args = (num_replicas, num_groups, num_nodes, num_gpus, max_slots_per_gpu, avoid_duplicates)
    return _rebalance(w[None], np.ones(1), w32, *args)


def rebalance_experts_over_window(
    weight: torch.Tensor | np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    time_weights: torch.Tensor | np.ndarray | list[float] | None = None,
    max_slots_per_gpu: int | None = None,
    avoid_duplicates: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Place experts for a window of steps: minimize sum_t time_weights[t] * (max GPU load at step t).

    weight: [T, L, E] load per step (e.g. the recorder's logical_count). A step's time is set by its
    slowest GPU, so this objective is the time of the window, which a placement for the summed load
    (rebalance_experts) does not see. time_weights: [T] non-negative, default all ones. Returns as
    rebalance_experts. The reference's placement for the summed load is one of the candidates, so the
    result is never worse than it on this objective.
    """
    w = _as_float64(weight)
    if w.ndim != 3:
        raise ValueError(f"weight must be [steps, layers, experts], got shape {tuple(w.shape)}")
    tw = np.ones(w.shape[0]) if time_weights is None else _as_float64(time_weights).reshape(-1)
    if tw.shape[0] != w.shape[0] or not np.all(np.isfinite(tw)) or np.any(tw < 0) or tw.sum() <= 0:
        raise ValueError(f"time_weights must be {w.shape[0]} finite non-negative numbers, not all zero")
    w32 = np.einsum("t,tle->le", tw, w).astype(np.float32)
    args = (num_replicas, num_groups, num_nodes, num_gpus, max_slots_per_gpu, avoid_duplicates)
    return _rebalance(w, tw, w32, *args)


def rebalance_experts_reference(
    weight: torch.Tensor | np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek's reference policy alone (its steps in float32, its tie-breaks, no local search), with the same
    arguments and returns as rebalance_experts [L, E]: what --eplb-algorithm deepseek runs."""
    if (w := _as_float64(weight)).ndim != 2:
        raise ValueError(f"weight must be [layers, experts], got shape {tuple(w.shape)}")
    _validate(w[None], num_replicas, num_groups, num_nodes, num_gpus, None)
    if not is_hierarchical(num_groups, num_nodes):
        num_groups = num_nodes = 1
    p = _Problem(num_replicas, num_groups, num_nodes, num_gpus, w.shape[1])
    phy2log = torch.from_numpy(np.ascontiguousarray(_reference_candidate(_as_float32(weight), p).to_phy2log()))
    log2phy, logcnt = logical_to_physical_map(phy2log, w.shape[1])
    return phy2log, log2phy, logcnt


def is_hierarchical(num_groups: int, num_nodes: int) -> bool:
    """Whether rebalance_experts uses the hierarchical policy (groups packed to nodes) for these sizes."""
    return num_groups > 0 and num_groups % num_nodes == 0


def logical_to_physical_map(phy2log: torch.Tensor,
                            num_logical_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse maps of a placement: phy2log [L, R] int -> (log2phy [L, E, X] int64 padded -1, logcnt [L, E]).

    log2phy lists each expert's slots in ascending order; X is the largest replica count (at least 1).
    """
    p2l = torch.as_tensor(phy2log).to("cpu", torch.int64)
    num_layers, num_slots = p2l.shape
    logcnt = torch.zeros(num_layers, num_logical_experts, dtype=torch.int64)
    logcnt.scatter_add_(1, p2l, torch.ones_like(p2l))
    width = max(int(logcnt.max()), 1) if logcnt.numel() else 1
    # [L, R] slot ids grouped by expert, ascending within an expert
    slots_by_expert = torch.argsort(p2l * num_slots + torch.arange(num_slots), dim=1)
    starts = torch.cumsum(logcnt, 1) - logcnt  # [L, E] first position of each expert in slots_by_expert
    experts_sorted = torch.gather(p2l, 1, slots_by_expert)  # [L, R]
    rank = torch.arange(num_slots).expand(num_layers, -1) - torch.gather(starts, 1, experts_sorted)
    log2phy = torch.full((num_layers, num_logical_experts * width), -1, dtype=torch.int64)
    log2phy.scatter_(1, experts_sorted * width + rank, slots_by_expert)
    return log2phy.view(num_layers, num_logical_experts, width), logcnt


# ---------------------------------------------------------------------------------------------------------
# Driver: validate, build candidates, keep the best per layer
# ---------------------------------------------------------------------------------------------------------


def _rebalance(
    w_tle: np.ndarray,  # [T, L, E] float64
    tw: np.ndarray,  # [T] float64
    w32: np.ndarray,  # [L, E] float32, what the reference would see
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    max_slots_per_gpu: int | None,
    avoid_duplicates: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, num_layers, num_experts = w_tle.shape
    _validate(w_tle, num_replicas, num_groups, num_nodes, num_gpus, max_slots_per_gpu)
    if not is_hierarchical(num_groups, num_nodes):
        num_groups = num_nodes = 1
    w_lte = np.ascontiguousarray(w_tle.transpose(1, 2, 0))  # [L, E, T]
    p = _Problem(num_replicas, num_groups, num_nodes, num_gpus, num_experts)

    ref = _reference_candidate(w32, p)
    ours = [_our_candidate(w_lte, tw, p, ref.nodes)]
    if num_groups // num_nodes > 1:
        ours.insert(0, _our_candidate(w_lte, tw, p, _our_node_layout(w_lte, tw, p)))
    best = _Best(w_lte, tw, num_gpus)
    for cand in ours:  # earlier candidates win ties
        best.offer(cand.polish(w_lte, tw, allow_new_dups=False))
    # Where a duplicate-free placement would be worse than the reference (or duplicates are welcome), search
    # with duplicates allowed too; the reference candidate is polished only where it can still win.
    ref_raw = ref.to_phy2log()
    if avoid_duplicates:
        tol = _REL_TOL * best.obj
        redo = best.obj > _objective(w_lte, tw, ref_raw, num_gpus) + tol
    else:
        redo = np.ones(num_layers, dtype=bool)
    if redo.any():
        for cand in ours:
            best.offer(cand.polish(w_lte, tw, redo), redo)
        wins = np.zeros(num_layers, dtype=bool)
        wins[redo] = best.would_take(ref_raw[redo], redo)
        if wins.any():
            best.offer(ref.polish(w_lte, tw, wins), wins)

    phy2log = torch.from_numpy(best.phy2log)
    log2phy, logcnt = logical_to_physical_map(phy2log, num_experts)
    assert int(logcnt.min()) >= 1 and bool((logcnt.sum(1) == num_replicas).all())
    return phy2log, log2phy, logcnt


class _Problem:
    """Sizes of one placement problem; a sub-problem is one (layer, node) pair."""

    def __init__(self, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int, num_experts: int):
        self.R, self.G, self.N, self.P, self.E = num_replicas, num_groups, num_nodes, num_gpus, num_experts
        self.slots_per_gpu = num_replicas // num_gpus  # S
        self.gpus_per_node = num_gpus // num_nodes  # P'
        self.slots_per_node = num_replicas // num_nodes  # R'
        self.experts_per_node = num_experts // num_nodes  # E'
        self.group_size = num_experts // num_groups


class _Best:
    """The best placement per layer so far, by (objective, duplicate replicas on one GPU)."""

    def __init__(self, w_lte: np.ndarray, tw: np.ndarray, num_gpus: int):
        self.w_lte, self.tw, self.num_gpus = w_lte, tw, num_gpus
        self.phy2log: np.ndarray | None = None  # [L, R]
        self.obj: np.ndarray | None = None  # [L] objective of phy2log
        self.dups: np.ndarray | None = None  # [L] replicas on a GPU that already holds their expert

    def _score(self, phy2log: np.ndarray, layers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        obj = _objective(self.w_lte[layers], self.tw, phy2log, self.num_gpus)
        return obj, _duplicates(phy2log, self.num_gpus)

    def would_take(self, phy2log: np.ndarray, layers: np.ndarray | None = None) -> np.ndarray:
        """Which of the given layers phy2log [len(layers), R] strictly improves -> bool [len(layers)]."""
        layers = np.arange(len(self.w_lte)) if layers is None else np.flatnonzero(layers)
        if self.phy2log is None:
            return np.ones(len(layers), dtype=bool)
        obj, dups = self._score(phy2log, layers)
        tol = _REL_TOL * self.obj[layers]
        return (obj < self.obj[layers] - tol) | ((obj <= self.obj[layers] + tol) & (dups < self.dups[layers]))

    def offer(self, phy2log: np.ndarray, layers: np.ndarray | None = None) -> None:
        """Keep phy2log [len(layers), R] on the layers (bool mask [L], default all) where it is better."""
        idx = np.arange(len(self.w_lte)) if layers is None else np.flatnonzero(layers)
        if self.phy2log is None:
            self.phy2log = phy2log.copy()
            self.obj, self.dups = self._score(phy2log, idx)
            return
        take = self.would_take(phy2log, layers)
        obj, dups = self._score(phy2log[take], idx[take])
        self.phy2log[idx[take]], self.obj[idx[take]], self.dups[idx[take]] = phy2log[take], obj, dups


class _Candidate:
    """One candidate placement as sub-problems (one per layer and node) before and after local search."""

    def __init__(self, p: _Problem, nodes: np.ndarray, cnt: np.ndarray, labels: np.ndarray,
                 slot_item: np.ndarray):
        self.p = p
        self.nodes = nodes  # [L, N, E'] logical ids held by each node
        self.cnt = cnt  # [B, E'] replicas per node-local expert, B = L * N (row l * N + n)
        self.labels = labels  # [B, R'] node-local expert of each item
        self.slot_item = slot_item  # [B, P', S] item in each slot

    def to_phy2log(self, layers: np.ndarray | None = None, slot_item: np.ndarray | None = None) -> np.ndarray:
        """The placement of the chosen layers (bool mask [L], default all) -> phy2log [len(layers), R]."""
        rows = self._rows(layers)
        slot_item = self.slot_item[rows] if slot_item is None else slot_item
        local = np.take_along_axis(self.labels[rows], slot_item.reshape(len(rows), -1), 1)  # [B', R']
        nodes = self.nodes if layers is None else self.nodes[layers]
        phy2log = np.take_along_axis(nodes, local.reshape(len(nodes), self.p.N, -1), 2)  # [L', N, R']
        return phy2log.reshape(len(nodes), self.p.R)

    def polish(self, w_lte: np.ndarray, tw: np.ndarray, layers: np.ndarray | None = None,
               allow_new_dups: bool = True) -> np.ndarray:
        """Local search in float64 on the true objective -> phy2log [len(layers), R]."""
        rows = self._rows(layers)
        nodes = self.nodes if layers is None else self.nodes[layers]
        w_sub = _node_loads(w_lte if layers is None else w_lte[layers], nodes)  # [B', E', T]
        labels = self.labels[rows]
        v = np.take_along_axis(w_sub / self.cnt[rows][..., None], labels[..., None], 1)  # [B', R', T]
        slot_item = local_search(self.slot_item[rows], v, tw, labels, self.p.experts_per_node, allow_new_dups)
        return self.to_phy2log(layers, slot_item)

    def _rows(self, layers: np.ndarray | None) -> np.ndarray:
        num_rows = len(self.labels)
        if layers is None:
            return np.arange(num_rows)
        return np.flatnonzero(np.repeat(layers, self.p.N))


def _validate(w_tle: np.ndarray, R: int, G: int, N: int, P: int, max_slots_per_gpu: int | None) -> None:
    _, num_layers, num_experts = w_tle.shape
    if num_layers == 0 or num_experts == 0:
        raise ValueError(f"weight has no layers or no experts (shape {tuple(w_tle.shape)})")
    if not np.all(np.isfinite(w_tle)) or np.any(w_tle < 0):
        raise ValueError("weight must be finite and non-negative (it counts tokens per expert)")
    if min(R, G, N, P) <= 0:
        raise ValueError(
            f"num_replicas={R}, num_groups={G}, num_nodes={N}, num_gpus={P} must all be positive")
    if R % P:
        raise ValueError(f"num_replicas={R} must be a multiple of num_gpus={P} (equal slots per GPU)")
    if R < num_experts:
        raise ValueError(
            f"num_replicas={R} is fewer than the {num_experts} logical experts: each needs a slot")
    if is_hierarchical(G, N) and P % N:
        raise ValueError(f"num_gpus={P} must be a multiple of num_nodes={N} (hierarchical policy)")
    if max_slots_per_gpu is not None and R // P > max_slots_per_gpu:
        raise ValueError(
            f"{R // P} slots per GPU (num_replicas / num_gpus) exceed max_slots_per_gpu={max_slots_per_gpu}")
    if is_hierarchical(G, N) and num_experts % G:
        raise ValueError(f"{num_experts} experts do not split into num_groups={G} equal groups")


def _as_float64(x: torch.Tensor | np.ndarray | list[float]) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def _as_float32(x: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float32)


# ---------------------------------------------------------------------------------------------------------
# Candidates
# ---------------------------------------------------------------------------------------------------------


def _reference_candidate(w32: np.ndarray, p: _Problem) -> _Candidate:
    """The reference's placement: its steps in float32 with its tie-breaks, from w32 [L, E]."""
    num_layers = w32.shape[0]
    gpn = p.G // p.N
    # Step 1: groups to nodes. node_groups[l, n, k] = the k-th group packed to node n.
    if gpn == 1:
        node_groups = np.broadcast_to(np.arange(p.G).reshape(1, p.N, 1), (num_layers, p.N, 1))
    else:
        group_w = torch.from_numpy(w32).unflatten(-1, (p.G, p.group_size)).sum(-1)  # [L, G] float32
        order = torch.sort(group_w, dim=-1, descending=True).indices.numpy()
        node_groups = _lpt(order, group_w.numpy()[..., None], np.ones(1), None, 0, p.N, avoid_dups=False)
    nodes = _expand_groups(node_groups, p.group_size)  # [L, N, E']

    # Step 2: greedy replication inside each node, float32, ties to the lowest index.
    w_sub32 = np.take_along_axis(w32, nodes.reshape(num_layers, -1), 1).reshape(-1, p.experts_per_node)
    cnt, added = _greedy_counts(w_sub32, p.slots_per_node, cap=None, spread_ties=False)
    labels = np.concatenate([np.broadcast_to(np.arange(p.experts_per_node), cnt.shape), added], 1)  # [B, R']

    # Step 3: replicas to GPUs by LPT on the per-replica load, float32.
    if p.slots_per_gpu == 1:
        slot_item = np.arange(p.slots_per_node).reshape(1, -1, 1).repeat(len(labels), 0)
    else:
        v32 = np.take_along_axis(w_sub32 / cnt.astype(np.float32), labels, 1)  # [B, R'] float32
        order = torch.sort(torch.from_numpy(v32), dim=-1, descending=True).indices.numpy()
        slot_item = _lpt(order, v32[..., None], np.ones(1), None, 0, p.gpus_per_node, avoid_dups=False)
    return _Candidate(p, nodes, cnt, labels, slot_item)


def _our_candidate(w_lte: np.ndarray, tw: np.ndarray, p: _Problem, nodes: np.ndarray) -> _Candidate:
    """Capped greedy counts and duplicate-avoiding LPT on a given node layout [L, N, E']."""
    w_sub = _node_loads(w_lte, nodes)  # [B, E', T]
    cap = p.gpus_per_node if p.slots_per_gpu <= p.experts_per_node else None
    cnt, added = _greedy_counts(w_sub @ tw, p.slots_per_node, cap=cap, spread_ties=True)
    labels = np.concatenate([np.broadcast_to(np.arange(p.experts_per_node), cnt.shape), added], 1)
    labels = np.sort(labels, axis=1)  # replicas of one expert adjacent, so LPT spreads them
    v = np.take_along_axis(w_sub / cnt[..., None], labels[..., None], 1)  # [B, R', T]
    if p.slots_per_gpu == 1:
        slot_item = np.arange(p.slots_per_node).reshape(1, -1, 1).repeat(len(labels), 0)
    else:
        order = np.argsort(-(v @ tw), axis=1, kind="stable")
        slot_item = _lpt(order, v, tw, labels, p.experts_per_node, p.gpus_per_node, avoid_dups=True)
    return _Candidate(p, nodes, cnt, labels, slot_item)


def _our_node_layout(w_lte: np.ndarray, tw: np.ndarray, p: _Problem) -> np.ndarray:
    """Groups to nodes by LPT plus local search on the node loads -> node layout [L, N, E']."""
    num_layers = w_lte.shape[0]
    group_w = w_lte.reshape(num_layers, p.G, p.group_size, -1).sum(2)  # [L, G, T]
    order = np.argsort(-(group_w @ tw), axis=1, kind="stable")
    labels = np.broadcast_to(np.arange(p.G), (num_layers, p.G))
    node_groups = _lpt(order, group_w, tw, labels, p.G, p.N, avoid_dups=False)
    node_groups = local_search(node_groups, group_w, tw, labels, p.G)
    return _expand_groups(node_groups, p.group_size)


def _expand_groups(node_groups: np.ndarray, group_size: int) -> np.ndarray:
    """[L, N, groups per node] group ids -> [L, N, E'] logical expert ids (groups in order, experts ascending)."""
    experts = node_groups[..., None] * group_size + np.arange(group_size)
    return experts.reshape(*node_groups.shape[:2], -1)


def _node_loads(w_lte: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """[L, E, T] loads, node layout [L, N, E'] -> [L * N, E', T] loads of each node's experts."""
    num_layers, num_nodes, per_node = nodes.shape
    w = np.take_along_axis(w_lte, nodes.reshape(num_layers, -1)[..., None], 1)
    return w.reshape(num_layers * num_nodes, per_node, -1)


# ---------------------------------------------------------------------------------------------------------
# Building blocks (vectorized over a batch B of independent problems)
# ---------------------------------------------------------------------------------------------------------


def _greedy_counts(w: np.ndarray, num_slots: int, cap: int | None,
                   spread_ties: bool) -> tuple[np.ndarray, np.ndarray]:
    """Give each extra slot to the expert with the largest load per replica.

    w [B, E] (its dtype is the arithmetic); cap: at most this many replicas per expert; spread_ties: among
    equal load per replica prefer the expert with fewer replicas (else the lowest index, as the reference).
    Returns cnt [B, E] int64 and added [B, num_slots - E] int64, the expert of each extra replica in order.
    """
    num_rows, num_experts = w.shape
    cnt = np.ones((num_rows, num_experts), dtype=np.int64)
    added = np.empty((num_rows, num_slots - num_experts), dtype=np.int64)
    rows = np.arange(num_rows)
    for k in range(num_slots - num_experts):
        per_replica = w / cnt.astype(w.dtype)
        if cap is not None:
            per_replica = np.where(cnt >= cap, -np.inf, per_replica)
        if spread_ties:
            tied = per_replica >= per_replica.max(1, keepdims=True)
            expert = np.argmin(np.where(tied, cnt, np.iinfo(np.int64).max), 1)
        else:
            expert = np.argmax(per_replica, 1)
        added[:, k] = expert
        cnt[rows, expert] += 1
    return cnt, added


def _lpt(
    order: np.ndarray,  # [B, n] items in the order they are placed
    v: np.ndarray,  # [B, n, T] item loads (dtype is the arithmetic)
    tw: np.ndarray,  # [T]
    labels: np.ndarray | None,  # [B, n] in [0, num_labels) (expert of each item) or None
    num_labels: int,
    num_packs: int,
    avoid_dups: bool,
) -> np.ndarray:
    """Longest-processing-time packing with exactly n / num_packs items per pack -> slot_item [B, packs, S].

    Each item goes to the non-full pack that raises the objective least (with one step: the lightest pack,
    lowest index on ties, as the reference); with avoid_dups, to a pack not yet holding its label if any.
    """
    num_rows, n, num_steps = v.shape
    per_pack = n // num_packs
    rows = np.arange(num_rows)
    loads = np.zeros((num_rows, num_packs, num_steps), dtype=v.dtype)
    fill = np.zeros((num_rows, num_packs), dtype=np.int64)
    slot_item = np.empty((num_rows, num_packs, per_pack), dtype=np.int64)
    has = np.zeros((num_rows, num_packs, num_labels), dtype=bool) if avoid_dups else None
    for k in range(n):
        item = order[:, k]
        item_load = v[rows, item]  # [B, T]
        open_ = fill < per_pack
        if avoid_dups:
            lab = labels[rows, item]
            fresh = open_ & ~has[rows, :, lab]
            open_ = np.where(fresh.any(1, keepdims=True), fresh, open_)
        if num_steps == 1:
            pack = np.argmin(np.where(open_, loads[..., 0], np.inf), 1)
        else:
            peak = loads.max(1)  # [B, T]
            rise = np.maximum(loads + item_load[:, None] - peak[:, None], 0) @ tw  # [B, packs]
            rise = np.where(open_, rise, np.inf)
            tied = rise <= rise.min(1, keepdims=True)
            pack = np.argmin(np.where(tied, loads @ tw, np.inf), 1)
        slot_item[rows, pack, fill[rows, pack]] = item
        fill[rows, pack] += 1
        loads[rows, pack] += item_load
        if avoid_dups:
            has[rows, pack, lab] = True
    return slot_item


# ---------------------------------------------------------------------------------------------------------
# Scoring candidates
# ---------------------------------------------------------------------------------------------------------


def _objective(w_lte: np.ndarray, tw: np.ndarray, phy2log: np.ndarray, num_gpus: int) -> np.ndarray:
    """Per layer: sum_t tw[t] * max over GPUs of the load at step t (replicas split an expert evenly) -> [L]."""
    num_layers, num_experts, _ = w_lte.shape
    cnt = np.zeros((num_layers, num_experts))
    np.add.at(cnt, (np.arange(num_layers)[:, None], phy2log), 1)
    per_replica = w_lte / np.maximum(cnt, 1)[..., None]  # [L, E, T]
    slot = np.take_along_axis(per_replica, phy2log[..., None], 1)  # [L, R, T]
    gpu = slot.reshape(num_layers, num_gpus, phy2log.shape[1] // num_gpus, w_lte.shape[2]).sum(2)  # [L, P, T]
    return gpu.max(1) @ tw


def _duplicates(phy2log: np.ndarray, num_gpus: int) -> np.ndarray:
    """Per layer: how many replicas sit on a GPU that already holds the same expert -> [L]."""
    num_layers = phy2log.shape[0]
    per_gpu = np.sort(phy2log.reshape(num_layers, num_gpus, phy2log.shape[1] // num_gpus), axis=2)
    return (per_gpu[..., 1:] == per_gpu[..., :-1]).sum((1, 2))
