"""A rank's expert-load machinery: the expert-distribution recorder and the online rebalancer (EPLB), built from
the flags and attached to the loaded model.

The recorder counts, on the device, the tokens each MoE layer routes to each logical expert; with --enable-eplb
the rebalancer (moeserve/eplb/rebalancer.py) reads those counts every --eplb-rebalance-num-iterations passes and
moves experts between this rank's slots while serving goes on.
"""

from __future__ import annotations

import dataclasses

import torch

from moeserve.args import ServerArgs
from moeserve.core.forward_batch import DECODE_LEN
from moeserve.core.model_config import ModelConfig
from moeserve.eplb.rebalancer import STAGING_CPU_DEFAULT, STAGING_FREE_SHARE, Rebalancer
from moeserve.eplb.recorder import ExpertDistributionRecorder
from moeserve.models.decoder import CausalLM
from moeserve.models.expert_weights import expert_source
from moeserve.models.options import rebalance_options
from moeserve.parallel.state import get_parallel_state


def make_recorder(args: ServerArgs, config: ModelConfig, model: CausalLM,
                  device: torch.device) -> ExpertDistributionRecorder | None:
    """The recorder the flags ask for (--enable-eplb needs one: stat unless a mode is given), installed in the
    model's MoE layers before CUDA graphs or torch.compile see them; None without MoE layers or a mode."""
    mode = args.expert_distribution_recorder_mode or ("stat" if args.enable_eplb else None)
    if mode is None or not config.moe_layers:
        return None
    rows = max(args.max_prefill_tokens, DECODE_LEN * max(args.max_running_requests, args.cuda_graph_max_bs))  # tokens
    recorder = ExpertDistributionRecorder(config.moe_layers, config.num_experts, device, mode,
                                          args.expert_distribution_recorder_buffer_size,
                                          config.num_experts_per_tok, rows)
    model.set_expert_recorder(recorder)
    return recorder


def make_rebalancer(args: ServerArgs, config: ModelConfig, model: CausalLM, recorder: ExpertDistributionRecorder,
                    device: torch.device, staging_bytes: int | None = None) -> Rebalancer | None:
    """The online rebalancer of this rank (--enable-eplb), or None; staging_bytes: its staging cap
    (eplb_staging_bytes)."""
    if not args.enable_eplb or not config.moe_layers:
        return None
    ps = get_parallel_state()
    source = expert_source(model, args.model_path, args.load_format, args.eplb_expert_weights, args.random_seed)
    options = dataclasses.replace(rebalance_options(args, config), staging_max_bytes=staging_bytes)
    return Rebalancer(model.moe_layers(), model.expert_location, source, recorder.counts, options, ps.ep_rank,
                      ps.world_cpu_group, device)


def eplb_staging_bytes(args: ServerArgs, config: ModelConfig, device: torch.device) -> int:
    """The device memory an online rebalance may stage (--eplb-staging-max-mb, or its default: a share of the free
    device memory on CUDA, a fixed size on the CPU); 0 without --enable-eplb."""
    if not args.enable_eplb or not config.moe_layers:
        return 0
    if args.eplb_staging_max_mb is not None:
        return int(args.eplb_staging_max_mb * 2**20)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] * STAGING_FREE_SHARE)
    return STAGING_CPU_DEFAULT
