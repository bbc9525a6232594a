"""The model's options: the one place where the server's flags (ServerArgs) become what models and layers read.

Layers never see ServerArgs: an MoE layer gets MoEOptions (dispatch backend and mode, experts' kernels, placement,
two-batch overlap, replica choice), the decoder gets ModelOptions, the online rebalancer RebalanceOptions. The worker asks `dispatch_options` whether the dispatchers need a
process group; the model runner asks the built dispatchers whether decode can be captured in CUDA graphs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from moeserve.args import ServerArgs
from moeserve.core.model_config import ModelConfig
from moeserve.ep.registry import DispatchOptions
from moeserve.eplb.location import ExpertLocation
from moeserve.eplb.rebalancer import RebalanceOptions
from moeserve.layers.moe.layer import MoEOptions
from moeserve.parallel.state import get_parallel_state

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelOptions:
    """How a model runs beyond its config.json: its MoE layers' options and two-batch overlap."""

    moe: MoEOptions = field(default_factory=MoEOptions)
    two_batch_overlap: bool = False  # --enable-two-batch-overlap
    tbo_token_threshold: int = 64  # --tbo-token-threshold: steps with fewer tokens (on every rank) do not overlap
    dp_lm_head: bool = False  # --enable-dp-lm-head: the LM head split by vocabulary over the attention-TP group
    fake_routing: bool = False  # --ep-dispatch-algorithm fake: the gates pick experts uniformly at random


def rebalance_options(args: ServerArgs, config: ModelConfig) -> RebalanceOptions:
    """--enable-eplb's flags (the online rebalancer runs on every rank)."""
    fail = None
    if args.eplb_debug_fail:
        phase, _, rank = args.eplb_debug_fail.partition(":")
        fail = (phase, int(rank))
    return RebalanceOptions(
        interval=args.eplb_rebalance_num_iterations, layers_per_chunk=args.eplb_rebalance_layers_per_chunk,
        utilization_threshold=args.eplb_min_rebalancing_utilization_threshold,
        min_improvement=args.eplb_min_improvement, algorithm=args.eplb_algorithm,
        dynamic_dispatch=args.ep_dispatch_algorithm == "dynamic", num_groups=config.n_group or 1, fail=fail)


def dispatch_options(args: ServerArgs) -> DispatchOptions:
    """--moe-a2a-backend, --deepep-mode, --ep-max-tokens-per-rank."""
    return DispatchOptions(backend=args.moe_a2a_backend, deepep_mode=args.deepep_mode,
                           max_tokens_per_rank=args.ep_max_tokens_per_rank)


def fp8_slots_split(args: ServerArgs, config: ModelConfig) -> bool:
    """Unquantized, or FP8 where the shared MLP splits into slots on whole 128 x 128 scale blocks (one shared
    expert, or each one's intermediate a multiple of 128: DeepSeek-V3, V2-Lite; layers/quantization/fp8_mlp.py)."""
    fp8 = args.quantization is not None or config.fp8 is not None
    return not fp8 or config.num_shared_experts == 1 or config.moe_intermediate_size % 128 == 0


def fuse_shared_experts(args: ServerArgs, config: ModelConfig, device: torch.device | None) -> bool:
    """--enable-shared-experts-fusion (checked), --disable-shared-experts-fusion, or by default: fused on CUDA where
    one rank runs the whole model through the Triton experts, in bf16/fp16/fp32 or in FP8 where the shared experts
    split on the scale blocks, with the trivial placement and no recorder (bf16 decode at batch 1 measured 8% faster
    fused on an H200, prefill the same; FP8 decode at batch 256 ran its shared experts as two dense FP8 GEMMs a
    layer, 0.83 ms a step: docs/BENCHMARKS.md); apart everywhere else."""
    if args.enable_shared_experts_fusion:
        if not config.num_shared_experts:
            raise ValueError(f"--enable-shared-experts-fusion: {config.architecture} has no shared experts")
        return True
    auto = (not args.disable_shared_experts_fusion and device is not None and device.type == "cuda"
            and bool(config.num_shared_experts) and args.tp_size == 1 and args.ep_size == 1
            and args.moe_a2a_backend == "none"  # all2all's low-latency slots hold top_k (+ shared) ids a token
            and not args.enable_dp_attention and not args.enable_eplb and not args.ep_num_redundant_experts
            and fp8_slots_split(args, config) and args.moe_runner_backend in ("auto", "triton")
            and not args.enable_torch_compile and not args.enable_two_batch_overlap
            and args.init_expert_location == "trivial" and args.expert_distribution_recorder_mode is None)
    if auto:
        logger.info("shared experts fused into the routed experts' kernels (the default on one CUDA rank; "
                    "--disable-shared-experts-fusion keeps them apart)")
    return auto


def model_options(args: ServerArgs, config: ModelConfig, device: torch.device | None = None) -> ModelOptions:
    """The options of `config`'s model on this rank (the EP size comes from moeserve.parallel.state); device: where
    it runs (None: not known, no default that depends on it)."""
    moe = MoEOptions(dispatch=dispatch_options(args), runner_backend=args.moe_runner_backend,
                     num_redundant_experts=args.ep_num_redundant_experts,
                     placement=expert_location(config, args, get_parallel_state().ep_size),
                     two_batch_overlap=args.enable_two_batch_overlap,
                     dynamic_dispatch=args.ep_dispatch_algorithm == "dynamic", rebalance=args.enable_eplb,
                     fuse_shared_experts=fuse_shared_experts(args, config, device))
    fake_routing = args.ep_dispatch_algorithm == "fake"
    if fake_routing:
        logger.warning("--ep-dispatch-algorithm fake: every token goes to experts picked uniformly at random, to "
                       "measure the balance perfect EPLB would reach; the outputs are meaningless")
    return ModelOptions(moe=moe, two_batch_overlap=args.enable_two_batch_overlap,
                        tbo_token_threshold=args.tbo_token_threshold, dp_lm_head=args.enable_dp_lm_head,
                        fake_routing=fake_routing)


def expert_location(config: ModelConfig, args: ServerArgs, ep_size: int) -> ExpertLocation | None:
    """The placement of every MoE layer (in config.moe_layers order) over ep_size ranks, or None for the trivial
    placement without redundant slots (slot e holds expert e).

    --init-expert-location trivial: slot r holds logical expert r % E (redundant slots repeat the first experts);
    a file: a placement saved by moeserve.eplb, or a recorder dump (logical_count) to plan one from."""
    if not config.moe_layers:
        return None
    num_physical = config.num_experts + args.ep_num_redundant_experts
    trivial = args.init_expert_location == "trivial"
    maps_change = args.enable_eplb or args.ep_dispatch_algorithm == "dynamic"
    if trivial and num_physical == config.num_experts and not maps_change:
        return None
    gpus_per_node = max(1, ep_size // max(1, args.nnodes))
    with torch.device("cpu"):  # models are built under torch.device("meta"): the maps are host tables
        if trivial:
            return ExpertLocation.trivial(len(config.moe_layers), config.num_experts, num_physical, ep_size,
                                          gpus_per_node)
        return ExpertLocation.load(args.init_expert_location, ep_size, gpus_per_node,
                                   num_physical_experts=num_physical, num_groups=config.n_group or 1,
                                   num_layers=len(config.moe_layers), num_logical_experts=config.num_experts)
