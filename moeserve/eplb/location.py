"""Where experts live at serving time: logical <-> physical maps and the replica each rank sends a token to.

Physical slot r of a layer lives on EP rank (GPU) r // (R / ep_size); GPU g is on node g // num_gpus_per_node.
The maps are tensors of fixed shapes, so a new placement is copied into them in place (update_) and CUDA
graphs that captured them stay valid.

Dispatch picks, for a token routed to logical expert e, one of e's replicas:
  - static: a table per rank: a replica on the rank's own GPU, else one on its node, else one spread so that
    every replica of e is chosen by an even share of ranks;
  - dynamic: per token, uniformly at random (seeded generator) or round robin by token index.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

from moeserve.eplb.algorithm import (
    logical_to_physical_map,
    rebalance_experts,
    rebalance_experts_over_window,
)

__all__ = ["ExpertLocation"]

# --ep-dispatch-algorithm: select_physical's modes, and fake (SGLang's name): the router picks k experts uniformly at
# random (layers/moe/router.py), slots as static; a bound on what balancing can buy, with meaningless outputs
DISPATCH_ALGORITHMS = ("static", "dynamic", "fake")


@dataclass(eq=False)
class ExpertLocation:
    """The placement of every layer's experts and the dispatch tables derived from it (int64 tensors)."""

    physical_to_logical_map: torch.Tensor  # [L, R] logical expert in each slot
    logical_to_all_physical_map: torch.Tensor  # [L, E, R - E + 1] slots of each expert, ascending, -1 padded
    logical_to_all_physical_map_num_valid: torch.Tensor  # [L, E] replicas per expert, >= 1
    logical_to_rank_dispatch_physical_map: torch.Tensor  # [ep_size, L, E] slot each rank sends expert e to
    ep_size: int
    num_gpus_per_node: int

    # -----------------------------------------------------------------------------------------------------
    # Sizes

    @property
    def num_layers(self) -> int:
        return self.physical_to_logical_map.shape[0]

    @property
    def num_physical_experts(self) -> int:
        return self.physical_to_logical_map.shape[1]

    @property
    def num_logical_experts(self) -> int:
        return self.logical_to_all_physical_map.shape[1]

    @property
    def num_local_physical_experts(self) -> int:
        """Slots per GPU."""
        return self.num_physical_experts // self.ep_size

    @property
    def num_nodes(self) -> int:
        return self.ep_size // self.num_gpus_per_node

    # -----------------------------------------------------------------------------------------------------
    # Constructors

    @classmethod
    def from_placement(cls, phy2log: torch.Tensor | np.ndarray, ep_size: int,
                       num_gpus_per_node: int | None = None, *, num_logical_experts: int | None = None,
                       seed: int = 0) -> ExpertLocation:
        """Maps for placement phy2log [L, R] (logical expert of each slot) on ep_size GPUs.

        num_gpus_per_node: GPUs that share a fast network (default: all GPUs on one node).
        num_logical_experts: E (default: the largest id + 1). seed: ties in the static dispatch table.
        """
        p2l = torch.as_tensor(np.asarray(phy2log) if not isinstance(phy2log, torch.Tensor) else phy2log)
        if p2l.ndim != 2 or p2l.dtype.is_floating_point or p2l.dtype == torch.bool:
            raise ValueError(
                f"physical_to_logical_map must be an integer [layers, slots] array, got {p2l.dtype} "
                f"{tuple(p2l.shape)}")
        if p2l.numel() == 0:
            raise ValueError(f"physical_to_logical_map is empty (shape {tuple(p2l.shape)})")
        p2l = p2l.to("cpu", torch.int64).contiguous()
        num_layers, num_slots = p2l.shape
        gpn = ep_size if num_gpus_per_node is None else num_gpus_per_node
        num_experts = int(p2l.max()) + 1 if num_logical_experts is None else num_logical_experts
        _check_sizes(num_layers, num_experts, num_slots, ep_size, gpn)
        if int(p2l.min()) < 0 or int(p2l.max()) >= num_experts:
            raise ValueError(f"physical_to_logical_map holds ids outside [0, {num_experts}) logical experts")
        log2phy, logcnt = logical_to_physical_map(p2l, num_experts)
        if int(logcnt.min()) == 0:
            layer, expert = (int(i) for i in (logcnt == 0).nonzero()[0])
            raise ValueError(f"logical expert {expert} of layer {layer} has no replica in the placement")
        width = num_slots - num_experts + 1  # the most replicas an expert can have: shapes never change
        all_phys = torch.full((num_layers, num_experts, width), -1, dtype=torch.int64)
        all_phys[..., : log2phy.shape[2]] = log2phy
        dispatch = _rank_dispatch_map(p2l, all_phys, logcnt, ep_size, gpn, seed)
        return cls(p2l, all_phys, logcnt, dispatch, ep_size, gpn)

    @classmethod
    def trivial(cls, num_layers: int, num_logical_experts: int, num_physical_experts: int, ep_size: int,
                num_gpus_per_node: int | None = None) -> ExpertLocation:
        """No balancing: slot r holds logical expert r % E (redundant slots repeat the first experts)."""
        _check_sizes(num_layers, num_logical_experts, num_physical_experts, ep_size,
                     ep_size if num_gpus_per_node is None else num_gpus_per_node)
        p2l = (torch.arange(num_physical_experts) % num_logical_experts).repeat(num_layers, 1)
        return cls.from_placement(p2l, ep_size, num_gpus_per_node, num_logical_experts=num_logical_experts)

    @classmethod
    def from_logical_count(cls, logical_count: torch.Tensor | np.ndarray, num_physical_experts: int,
                           ep_size: int, num_nodes: int, num_groups: int, *, over_window: bool = False,
                           seed: int = 0) -> ExpertLocation:
        """Plan a placement for recorded loads logical_count [steps, L, E] or [L, E] (rebalance_experts).

        Steps are summed, unless over_window: then the placement minimizes the summed per-step maxima
        (rebalance_experts_over_window). num_groups: the model's expert groups (1 if it has none).
        """
        counts = torch.as_tensor(
            np.asarray(logical_count) if not isinstance(logical_count, torch.Tensor) else logical_count
        ).to("cpu", torch.float64)
        if counts.ndim not in (2, 3):
            raise ValueError(
                f"logical_count must be [steps, layers, experts] or [layers, experts], "
                f"got shape {tuple(counts.shape)}")
        if num_nodes <= 0 or ep_size % num_nodes:
            raise ValueError(f"ep_size={ep_size} must be a multiple of num_nodes={num_nodes}")
        args = (num_physical_experts, num_groups, num_nodes, ep_size)
        if counts.ndim == 3 and over_window:
            phy2log, _, _ = rebalance_experts_over_window(counts, *args)
        else:
            phy2log, _, _ = rebalance_experts(counts.sum(0) if counts.ndim == 3 else counts, *args)
        return cls.from_placement(
            phy2log, ep_size, ep_size // num_nodes, num_logical_experts=counts.shape[-1], seed=seed)

    # -----------------------------------------------------------------------------------------------------
    # Files

    def save(self, path: str | Path) -> Path:
        """Write the placement to .pt (torch) or .json; load() reads it back (with any ep_size dividing R)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "physical_to_logical_map": self.physical_to_logical_map.cpu(),
            "num_logical_experts": self.num_logical_experts,
            "ep_size": self.ep_size,
            "num_gpus_per_node": self.num_gpus_per_node,
        }
        if path.suffix == ".json":
            record["physical_to_logical_map"] = record["physical_to_logical_map"].tolist()
            path.write_text(json.dumps(record))
        else:
            torch.save(record, path)
        return path

    @classmethod
    def load(cls, path: str | Path, ep_size: int, num_gpus_per_node: int | None = None, *,
             num_physical_experts: int | None = None, num_groups: int | None = None,
             num_layers: int | None = None, num_logical_experts: int | None = None,
             seed: int = 0) -> ExpertLocation:
        """Read an --init-expert-location file: a saved placement or a recorder dump, .pt or .json.

        A placement holds `physical_to_logical_map` [L, R]. A recorder dump holds `logical_count`
        [steps, L, E] or [L, E] (SGLang's expert_distribution_recorder_*.pt); a placement is planned from it
        for num_physical_experts slots (required then) and num_groups (default 1). num_gpus_per_node
        defaults to the saved placement's, else all GPUs on one node. num_layers and num_logical_experts,
        when given, are checked against the file.
        """
        record = _read_record(Path(path))
        if "physical_to_logical_map" in record:
            file_experts = record.get("num_logical_experts")
            file_gpn = record.get("num_gpus_per_node")
            if (
                num_gpus_per_node is None
                and isinstance(file_gpn, int)
                and file_gpn > 0
                and ep_size % file_gpn == 0
            ):
                num_gpus_per_node = file_gpn  # the node size the placement was saved with
            loc = cls.from_placement(
                _as_tensor(record["physical_to_logical_map"]), ep_size, num_gpus_per_node,
                num_logical_experts=num_logical_experts if num_logical_experts is not None else file_experts,
                seed=seed)
            if num_physical_experts is not None and loc.num_physical_experts != num_physical_experts:
                raise ValueError(
                    f"{path} places {loc.num_physical_experts} physical experts per layer, the "
                    f"server has {num_physical_experts}")
        elif "logical_count" in record:
            if num_physical_experts is None:
                raise ValueError(
                    f"{path} is a recorder dump (logical_count): pass num_physical_experts to plan "
                    "a placement from it")
            gpn = ep_size if num_gpus_per_node is None else num_gpus_per_node
            if gpn <= 0 or ep_size % gpn:
                raise ValueError(f"ep_size={ep_size} must be a multiple of num_gpus_per_node={gpn}")
            loc = cls.from_logical_count(_as_tensor(record["logical_count"]), num_physical_experts, ep_size,
                                         ep_size // gpn, num_groups or 1, seed=seed)
        else:
            raise ValueError(
                f"{path} holds neither physical_to_logical_map nor logical_count (keys: {sorted(record)})")
        if num_layers is not None and loc.num_layers != num_layers:
            raise ValueError(f"{path} has {loc.num_layers} MoE layers, the model has {num_layers}")
        if num_logical_experts is not None and loc.num_logical_experts != num_logical_experts:
            raise ValueError(
                f"{path} has {loc.num_logical_experts} logical experts, the model has {num_logical_experts}")
        return loc

    # -----------------------------------------------------------------------------------------------------
    # Serving

    def update_(self, other: ExpertLocation) -> None:
        """Copy other's maps into this object's tensors in place (same shapes), so captured graphs see them."""
        if (other.ep_size, other.num_gpus_per_node) != (self.ep_size, self.num_gpus_per_node):
            raise ValueError(
                f"cannot update a location for ep_size={self.ep_size}, {self.num_gpus_per_node} "
                f"GPUs per node from one for {other.ep_size}, {other.num_gpus_per_node}")
        for name in _TENSOR_FIELDS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine.shape != theirs.shape:
                raise ValueError(
                    f"{name}: shape {tuple(theirs.shape)} differs from {tuple(mine.shape)}; "
                    "in-place update needs the same layers, experts and slots")
        for name in _TENSOR_FIELDS:
            getattr(self, name).copy_(getattr(other, name))

    def to(self, device: torch.device | str) -> ExpertLocation:
        """A copy with every map on device."""
        tensors = {name: getattr(self, name).to(device) for name in _TENSOR_FIELDS}
        return ExpertLocation(**tensors, ep_size=self.ep_size, num_gpus_per_node=self.num_gpus_per_node)

    def select_physical(self, topk_ids: torch.Tensor, layer: int | None, rank: int, mode: str = "static",
                        generator: torch.Generator | None = None) -> torch.Tensor:
        """Map routed logical ids to physical slots, on the maps' device, without host syncs.

        topk_ids: [T, k] logical ids of one layer, or [L, T, k] for all layers (layer=None).
        rank: the EP rank that sends the tokens. mode: 'static' (this rank's table) or 'dynamic' (tokens
        split over all replicas: uniformly at random from generator, or round robin by token index and rank
        when generator is None). Returns int64 physical ids, same shape as topk_ids.
        """
        if not 0 <= rank < self.ep_size:
            raise ValueError(f"rank {rank} outside [0, {self.ep_size})")
        ids = topk_ids.long()
        if layer is not None:
            ids = ids[None]  # [1, T, k]
            layers = slice(layer, layer + 1)
        else:
            if ids.ndim != 3 or ids.shape[0] != self.num_layers:
                raise ValueError(
                    f"with layer=None topk_ids must be [{self.num_layers}, T, k], got {tuple(ids.shape)}")
            layers = slice(None)
        flat = ids.flatten(1)  # [L', T*k]
        if mode == "static":
            out = self.logical_to_rank_dispatch_physical_map[rank, layers].gather(1, flat)
        elif mode == "dynamic":
            if generator is None:  # round robin by token index and rank
                cnt = self.logical_to_all_physical_map_num_valid[layers].gather(1, flat).view_as(ids)
                token = torch.arange(ids.shape[1], device=ids.device).view(1, -1, 1)
                u = ((token + rank) % cnt + 0.5) / cnt
            else:
                u = torch.rand(ids.shape, generator=generator, device=ids.device)
            out = torch.stack([pick_replicas(ids[i], self.logical_to_all_physical_map[layers][i],
                                             self.logical_to_all_physical_map_num_valid[layers][i], u[i])
                               for i in range(ids.shape[0])])
        else:
            raise ValueError(f"mode must be 'static' or 'dynamic', not {mode!r}")
        out = out.view_as(ids)
        return out[0] if layer is not None else out


def pick_replicas(topk_ids: torch.Tensor, replicas: torch.Tensor, num_replicas: torch.Tensor,
                  u: torch.Tensor) -> torch.Tensor:
    """Dynamic dispatch of one layer: topk_ids [T, k] logical -> physical slots, replica floor(u * count) of each
    expert (u [T, k] in [0, 1): uniform draws spread the tokens over the replicas alike). replicas [E, X] the
    slots of each expert (-1 padded), num_replicas [E]. Static shapes, no host sync (CUDA-graph safe)."""
    ids = topk_ids.long()
    cnt = num_replicas[ids]
    pick = torch.minimum((u * cnt).long(), cnt - 1)
    return replicas.view(-1)[ids * replicas.shape[1] + pick]


_TENSOR_FIELDS = tuple(
    f.name for f in fields(ExpertLocation) if f.name.endswith("_map") or f.name.endswith("_valid"))


# ---------------------------------------------------------------------------------------------------------
# Static dispatch table
# ---------------------------------------------------------------------------------------------------------


def _rank_dispatch_map(
    p2l: torch.Tensor,  # [L, R]
    all_phys: torch.Tensor,  # [L, E, X] slots ascending, -1 padded
    num_valid: torch.Tensor,  # [L, E]
    ep_size: int,
    gpus_per_node: int,
    seed: int,
) -> torch.Tensor:
    """For every rank, layer and logical expert, the slot the rank sends to -> [ep_size, L, E] int64.

    Own GPU first, then own node (round robin over the node's replicas), then the rest of the ranks are
    spread by water filling so that every replica ends with an even share of ranks. Only experts with
    several replicas need a choice; they are handled as one flat batch of M (layer, expert) pairs.
    """
    num_slots = p2l.shape[1]
    slots_per_gpu = num_slots // ep_size
    num_nodes = ep_size // gpus_per_node
    choice = all_phys[:, :, 0].expand(ep_size, -1, -1).clone()  # the only replica, for single-replica experts
    multi = (num_valid > 1).nonzero()  # [M, 2] (layer, expert)
    if len(multi) == 0:
        return choice
    width = int(num_valid.max())
    phys = all_phys[multi[:, 0], multi[:, 1], :width]  # [M, X]
    valid = phys >= 0
    gen = torch.Generator().manual_seed(seed)
    offset = torch.randint(0, 1 << 30, (len(multi),), generator=gen)  # rotates tie-breaks, [M]

    # 1. a replica on the rank's own GPU (the lowest slot if it holds several)
    gpu = torch.where(valid, phys // slots_per_gpu, -1)  # [M, X]
    mine = torch.zeros(ep_size, len(multi), dtype=torch.bool)
    pos = torch.zeros(ep_size, len(multi), dtype=torch.int64)
    for x in reversed(range(width)):  # the lowest slot is written last and wins
        m = valid[:, x].nonzero().squeeze(1)
        mine[gpu[m, x], m] = True
        pos[gpu[m, x], m] = x

    # 2. a replica on the rank's node: node replicas are contiguous in phys (slots ascend with nodes)
    node = torch.where(valid, gpu // gpus_per_node, num_nodes)  # [M, X]
    node_cnt = torch.zeros(len(multi), num_nodes + 1, dtype=torch.int64).scatter_add_(
        1, node, torch.ones_like(node))
    node_cnt = node_cnt[:, :num_nodes]  # [M, N]
    node_start = torch.cumsum(node_cnt, 1) - node_cnt
    rank_cnt = node_cnt.T.repeat_interleave(gpus_per_node, 0)  # [ep, M] replicas on the rank's node
    rank_start = node_start.T.repeat_interleave(gpus_per_node, 0)
    near = ~mine & (rank_cnt > 0)
    nth = near.view(num_nodes, gpus_per_node, -1).cumsum(1).view_as(near) - 1
    pos = torch.where(near, rank_start + (nth + offset) % rank_cnt.clamp(min=1), pos)

    # 3. ranks whose node holds no replica: water filling over all replicas
    remote = ~mine & ~near  # [ep, M]
    if bool(remote.any()):
        have = torch.zeros(len(multi), width, dtype=torch.int64)
        have.scatter_add_(1, pos.T, (~remote).T.long())  # ranks each replica serves so far
        extra = _water_fill(have, remote.sum(0), valid, offset)  # [M, X]
        nth = remote.cumsum(0) - 1  # [ep, M] index among this expert's remote ranks
        k = torch.searchsorted(torch.cumsum(extra, 1), nth.T.contiguous(), right=True).T  # [ep, M]
        pos = torch.where(remote, k.clamp(max=width - 1), pos)
    choice[:, multi[:, 0], multi[:, 1]] = phys.gather(1, pos.T).T
    assert int(choice.min()) >= 0
    return choice


def _water_fill(have: torch.Tensor, extra_total: torch.Tensor, valid: torch.Tensor, offset: torch.Tensor):
    """Split extra_total [M] ranks over replicas already serving have [M, X] ranks, lowest first -> [M, X].

    Every replica that gets ranks ends at the same level or one above; which ones get the one above rotates
    with offset [M].
    """
    width = have.shape[-1]
    have = torch.where(valid, have, 1 << 40)
    lo = have.amin(-1)  # [M]
    hi = lo + extra_total
    while bool((lo < hi).any()):  # the highest level whose fill fits in extra_total
        mid = (lo + hi + 1) // 2
        fill = (mid.unsqueeze(-1) - have).clamp(min=0).sum(-1)
        fits = fill <= extra_total
        lo, hi = torch.where(fits, mid, lo), torch.where(fits, hi, mid - 1)
    extra = (lo.unsqueeze(-1) - have).clamp(min=0)
    left = extra_total - extra.sum(-1)  # [M], fewer than the replicas at the level
    at_level = valid & (have + extra == lo.unsqueeze(-1))
    turn = (torch.arange(width) - offset.unsqueeze(-1)) % width
    order = torch.where(at_level, turn, width + turn).argsort(-1).argsort(-1)  # place in the rotation
    return extra + (at_level & (order < left.unsqueeze(-1))).long()


# ---------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------


def _check_sizes(num_layers: int, num_experts: int, num_slots: int, ep_size: int, gpus_per_node: int) -> None:
    if num_layers <= 0 or num_experts <= 0:
        raise ValueError(
            f"need at least one layer and one expert, got {num_layers} layers, {num_experts} experts")
    if ep_size <= 0 or num_slots % ep_size:
        raise ValueError(
            f"num_physical_experts={num_slots} must be a multiple of ep_size={ep_size} "
            "(every GPU holds the same number of expert slots)")
    if num_slots < num_experts:
        raise ValueError(f"num_physical_experts={num_slots} is fewer than the {num_experts} logical experts")
    if gpus_per_node <= 0 or ep_size % gpus_per_node:
        raise ValueError(f"ep_size={ep_size} must be a multiple of num_gpus_per_node={gpus_per_node}")


def _read_record(path: Path) -> dict:
    if not path.exists():
        raise ValueError(f"expert location file {path} does not exist")
    if path.suffix == ".json":
        record = json.loads(path.read_text())
    else:
        try:
            record = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - surface any unreadable file as a user error
            raise ValueError(f"cannot read {path} as a torch file: {e}") from e
    if not isinstance(record, dict):
        raise ValueError(f"{path} must hold a dict with physical_to_logical_map or logical_count")
    return record


def _as_tensor(x: object) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
