"""The expert placement a server runs with: --init-expert-location and --ep-num-redundant-experts.

`serving_location(config, server_args)` builds the ExpertLocation (moeserve/eplb/location.py) once per process and
every MoE layer reads its row: which logical expert each physical slot holds (what the layer loads), and the
static dispatch table of this EP rank (the slot a token routed to logical expert e goes to: a replica on this
rank's GPU if there is one, else on its node, else spread over the replicas).

Placements: `trivial` (slot r holds logical expert r % E, so redundant slots repeat the first experts), or a file
`ExpertLocation.load` reads: a saved placement, or a recorder dump (`logical_count`) to plan one from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moeserve.eplb.location import ExpertLocation

if TYPE_CHECKING:
    from moeserve.args import ServerArgs
    from moeserve.core.model_config import ModelConfig

_cache: dict[tuple, ExpertLocation] = {}


def serving_location(config: ModelConfig, server_args: ServerArgs, ep_size: int) -> ExpertLocation:
    """The placement of every MoE layer (in config.moe_layers order) for ep_size ranks; one per process."""
    num_physical = config.num_experts + server_args.ep_num_redundant_experts
    gpus_per_node = max(1, ep_size // max(1, server_args.nnodes))
    key = (server_args.init_expert_location, config.num_experts, num_physical, len(config.moe_layers), ep_size,
           gpus_per_node)
    if key not in _cache:
        with torch.device("cpu"):  # models are built under torch.device("meta"): the maps are host tables
            if server_args.init_expert_location == "trivial":
                loc = ExpertLocation.trivial(len(config.moe_layers), config.num_experts, num_physical, ep_size,
                                             gpus_per_node)
            else:
                loc = ExpertLocation.load(server_args.init_expert_location, ep_size, gpus_per_node,
                                          num_physical_experts=num_physical, num_groups=config.n_group or 1,
                                          num_layers=len(config.moe_layers), num_logical_experts=config.num_experts)
        _cache.clear()
        _cache[key] = loc
    return _cache[key]


def layer_placement(config: ModelConfig, server_args: ServerArgs | None, layer_id: int, ep_size: int,
                    ep_rank: int) -> tuple[list[int], torch.Tensor | None]:
    """(logical expert of each physical slot, this rank's dispatch table [E] int64 on the CPU or None).

    None: the identity (as many slots as experts, slot e holds expert e), where routed ids are slot ids."""
    if server_args is None:
        return list(range(config.num_experts)), None
    loc = serving_location(config, server_args, ep_size)
    i = config.moe_layers.index(layer_id)
    physical_to_logical = loc.physical_to_logical_map[i].tolist()
    if physical_to_logical == list(range(config.num_experts)):
        return physical_to_logical, None
    return physical_to_logical, loc.logical_to_rank_dispatch_physical_map[ep_rank, i].clone()
