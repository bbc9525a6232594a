"""Which logical expert each physical slot of an MoE layer holds, and where this rank sends a routed token.

The placement of a server (--init-expert-location, --ep-num-redundant-experts) is one ExpertLocation
(moeserve/eplb/location.py) for all MoE layers, built from the flags by moeserve/models/options.py. A layer reads its
row: the logical expert of each physical slot (what the layer loads), and this EP rank's static dispatch table (the
slot a token routed to logical expert e goes to: a replica on this rank's GPU if there is one, else on its node,
else spread over the replicas), or with dynamic dispatch every replica of each expert (one picked at random).
"""

from __future__ import annotations

import torch

from moeserve.eplb.location import ExpertLocation, pick_replicas


class LayerPlacement:
    """One MoE layer's row of the placement: `slots` (the logical expert of each physical slot) and the map from
    routed logical ids to physical slots (`to_physical`), updated in place by a rebalance (CUDA graphs read it)."""

    def __init__(self, location: ExpertLocation | None, moe_index: int, ep_rank: int, num_experts: int,
                 keep_table: bool = False, dynamic: bool = False):
        """location None: the trivial placement without redundant slots. keep_table: a table even where it is the
        identity (a rebalance updates it in place). dynamic: each token goes to one of the expert's replicas."""
        self.moe_index, self.ep_rank = moe_index, ep_rank
        self.slots = list(range(num_experts)) if location is None else location.physical_to_logical_map[
            moe_index].tolist()
        self.table: torch.Tensor | None = None  # [E] int64: logical -> this rank's physical slot; None: identity
        if keep_table or self.slots != list(range(num_experts)):
            self.table = (torch.arange(num_experts) if location is None
                          else location.logical_to_rank_dispatch_physical_map[ep_rank, moe_index].clone())
        self.replicas = self.num_replicas = None  # dynamic: [E, X] every replica of each expert, [E] how many
        if dynamic:
            if location is None:
                raise ValueError("--ep-dispatch-algorithm dynamic needs a placement (models/options.py builds one)")
            self.replicas = location.logical_to_all_physical_map[moe_index].clone()
            self.num_replicas = location.logical_to_all_physical_map_num_valid[moe_index].clone()

    @property
    def identity(self) -> bool:
        """Routed logical ids are the physical slots."""
        return self.table is None and self.replicas is None

    def to(self, device: torch.device) -> None:
        for name in ("table", "replicas", "num_replicas"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).to(device))

    def to_physical(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Logical topk_ids [T, k] -> physical slots [T, k]."""
        if self.replicas is not None:
            rand = torch.rand(topk_ids.shape, device=topk_ids.device)
            return pick_replicas(topk_ids, self.replicas, self.num_replicas, rand)
        if self.table is not None:
            return self.table.index_select(0, topk_ids.reshape(-1)).view_as(topk_ids)
        return topk_ids

    def update(self, location: ExpertLocation) -> None:
        """Take this layer's row of `location`, in place."""
        if self.table is not None:
            self.table.copy_(location.logical_to_rank_dispatch_physical_map[self.ep_rank, self.moe_index])
        if self.replicas is not None:
            self.replicas.copy_(location.logical_to_all_physical_map[self.moe_index])
            self.num_replicas.copy_(location.logical_to_all_physical_map_num_valid[self.moe_index])
