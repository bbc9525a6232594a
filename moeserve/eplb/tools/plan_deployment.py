"""Where and how the model runs: the deployment the step-time model (plan.py) takes and checks.

GPUs and nodes, the EP group, redundant experts, the phase with its batch and lengths, the dispatch mode,
two-batch overlap, MTP, and a balancedness (given, or estimated in plan_balancedness.py when None).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moeserve.eplb.tools.plan_models import ModelSpec


@dataclass(frozen=True)
class Deployment:
    """Where and how the model runs: GPUs, EP group, redundancy, batch, lengths, dispatch mode, TBO."""

    num_gpus: int = 72
    gpus_per_node: int = 8
    ep_size: int = 0  # GPUs in one EP group (0: all GPUs); num_gpus / ep_size groups serve independently
    redundant: int = 32
    phase: str = "decode"  # decode | prefill
    batch_per_gpu: int = 256  # decode: running sequences per GPU
    context_len: int = 2000  # decode: KV length per sequence
    tokens_per_gpu: int = 16384  # prefill: new (computed) tokens per GPU per step
    input_len: int = 2000  # prefill: prompt length
    cache_hit: float = 0.0  # prefill: fraction of prompt tokens already in the KV cache (not computed)
    dispatch: str = "auto"  # normal | low_latency | auto (prefill: normal, decode: low_latency)
    tbo: bool = True
    eplb: bool = True  # False: experts laid out without a load balancer (for the no-EPLB balancedness)
    balancedness: float | None = None  # None: estimated from a synthetic workload (simulate)
    mtp_draft: int = 0  # decode: draft tokens per sequence per step (multi-token prediction)
    mtp_accept: float = 0.8  # decode: expected accepted tokens per draft token

    @property
    def ep(self) -> int:
        return self.ep_size or self.num_gpus

    @property
    def ep_nodes(self) -> int:
        return max(1, math.ceil(self.ep / self.gpus_per_node))

    @property
    def dispatch_mode(self) -> str:
        if self.dispatch != "auto":
            return self.dispatch
        return "normal" if self.phase == "prefill" else "low_latency"

    def validate(self, model: ModelSpec) -> None:
        """Raise ValueError for a deployment the model cannot describe."""
        if self.phase not in ("decode", "prefill"):
            raise ValueError(f"phase must be decode or prefill, got {self.phase!r}")
        if self.dispatch not in ("auto", "normal", "low_latency"):
            raise ValueError(f"dispatch must be normal, low_latency or auto, got {self.dispatch!r}")
        if self.num_gpus < 1 or self.gpus_per_node < 1 or self.num_gpus % self.ep:
            raise ValueError(f"EP size {self.ep} must divide the {self.num_gpus} GPUs")
        if self.ep > self.gpus_per_node and self.ep % self.gpus_per_node:
            raise ValueError(f"an EP group of {self.ep} GPUs must fill whole nodes of {self.gpus_per_node}")
        if self.eplb and (model.num_experts + self.redundant) % self.ep:
            raise ValueError(
                f"experts + redundant = {model.num_experts + self.redundant} must be a multiple of "
                f"EP size {self.ep}; change --redundant")
        if self.balancedness is not None and not 0 < self.balancedness <= 1:
            raise ValueError(f"balancedness must be in (0, 1], got {self.balancedness}")
        if not 0 <= self.cache_hit < 1:
            raise ValueError(f"cache_hit must be in [0, 1), got {self.cache_hit}")
        if min(self.batch_per_gpu, self.context_len, self.tokens_per_gpu, self.input_len) < 1:
            raise ValueError("batch, context, tokens per GPU and input length must be >= 1")
