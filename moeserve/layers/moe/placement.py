"""Which logical expert each physical slot of an MoE layer holds, and where this rank sends a routed token.

The placement of a server (--init-expert-location, --ep-num-redundant-experts) is one ExpertLocation
(moeserve/eplb/location.py) for all MoE layers, built from the flags by moeserve/models/options.py. A layer reads its
row: the logical expert of each physical slot (what the layer loads), and this EP rank's static dispatch table (the
slot a token routed to logical expert e goes to: a replica on this rank's GPU if there is one, else on its node,
else spread over the replicas).
"""

from __future__ import annotations

import torch

from moeserve.eplb.location import ExpertLocation


def layer_placement(location: ExpertLocation | None, moe_index: int, ep_rank: int, num_experts: int,
                    keep_table: bool = False) -> tuple[list[int], torch.Tensor | None]:
    """(logical expert of each physical slot, this rank's dispatch table [E] int64 on the CPU, or None) of the
    `moe_index`-th MoE layer. None: the identity (as many slots as experts, slot e holds expert e), where routed
    ids are slot ids; keep_table: a table even then (a rebalance updates it in place). `location` None is the
    trivial placement without redundant slots."""
    if location is None:
        return list(range(num_experts)), (torch.arange(num_experts) if keep_table else None)
    physical_to_logical = location.physical_to_logical_map[moe_index].tolist()
    if physical_to_logical == list(range(num_experts)) and not keep_table:
        return physical_to_logical, None
    return physical_to_logical, location.logical_to_rank_dispatch_physical_map[ep_rank, moe_index].clone()
