"""Dispatch backends by name, and the one place the --moe-a2a-backend family of flags is interpreted.

    none       LocalDispatcher: every expert on this rank (ep_size 1). With ep_size > 1, `none` means allgather,
               the closest analogue of SGLang's default all-reduce MoE path (every rank sees every token).
    allgather  AllGatherDispatcher: every rank sees every token, runs its own experts, reduce-scatter (the oracle)
    all2all    All2AllDispatcher: torch.distributed all-to-all, --deepep-mode normal, low_latency or auto
    symm       SymmAll2AllDispatcher: all2all's modes, low-latency steps by row puts into peer memory (bytes
               scale with routed tokens; ep/symm.py). Where peer memory cannot run (ranks on several hosts, no
               symmetric memory in torch) it falls back to all2all with a warning that says why.

A new backend (DeepEP, say) is a Dispatcher subclass added to BACKENDS; make_dispatcher passes it the same
arguments as the others.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

import torch

from moeserve.ep.all2all import All2AllDispatcher, resolve_deepep_mode
from moeserve.ep.all2all_low_latency import FP8Quantize
from moeserve.ep.allgather import AllGatherDispatcher
from moeserve.ep.base import Dispatcher
from moeserve.ep.local import LocalDispatcher
from moeserve.ep.symm import SymmAll2AllDispatcher, symm_unavailable

logger = logging.getLogger(__name__)
_WARNED: set[str] = set()

BACKENDS: dict[str, type[Dispatcher]] = {
    LocalDispatcher.name: LocalDispatcher,
    AllGatherDispatcher.name: AllGatherDispatcher,
    All2AllDispatcher.name: All2AllDispatcher,
    SymmAll2AllDispatcher.name: SymmAll2AllDispatcher,
}
# SGLang's backend names that this install does not run -> why, and what runs instead. --moe-a2a-backend refuses
# them by name; a name leaves this table when its dispatcher joins BACKENDS.
_DEEPEP_WHY = ("DeepEP (`deep_ep`) does not import here" if importlib.util.find_spec("deep_ep") is None
               else "moeserve has no DeepEP dispatcher yet")
REFUSED_BACKENDS: dict[str, str] = {
    name: f"{why}: use --moe-a2a-backend all2all (the same normal / low_latency / auto modes over "
          "torch.distributed's all-to-all)"
    for name, why in {"deepep": _DEEPEP_WHY}.items() if name not in BACKENDS}


def resolve_backend(kind: str, ep_size: int) -> str:
    """The backend that runs: `none` with ep_size > 1 is allgather."""
    if kind not in BACKENDS:
        raise ValueError(f"unknown MoE dispatch backend {kind!r}; choose {', '.join(BACKENDS)}")
    return "allgather" if kind == "none" and ep_size > 1 else kind


@dataclass(frozen=True)
class DispatchOptions:
    """How MoE layers move tokens between EP ranks (--moe-a2a-backend, --deepep-mode, --ep-max-tokens-per-rank)."""

    backend: str = "none"
    deepep_mode: str = "auto"  # all2all and symm
    max_tokens_per_rank: int = 128  # all2all low-latency slot size

    def __post_init__(self) -> None:
        resolve_backend(self.backend, 1)  # bad names fail here, not at the first forward
        resolve_deepep_mode(self.deepep_mode, None)
        if self.max_tokens_per_rank < 1:
            raise ValueError(f"--ep-max-tokens-per-rank must be >= 1, got {self.max_tokens_per_rank}")

    @property
    def needs_process_group(self) -> bool:
        """The dispatchers talk through torch.distributed even on one rank."""
        return self.backend != "none"


def make_dispatcher(options: DispatchOptions, num_experts: int, num_local_experts: int, *,
                    dtype: torch.dtype, device: torch.device | str, hidden_size: int | None = None,
                    top_k: int | None = None, align: int = 1, ep_group: Any = None, ep_rank: int | None = None,
                    ep_size: int | None = None, fp8_quantize: FP8Quantize | None = None) -> Dispatcher:
    """A dispatcher for one MoE layer call site.

    num_experts: physical experts over all EP ranks; num_local_experts: those on this rank. dtype and device: the
    activations' (the EP backends' buffers). hidden_size and top_k size the EP backends' buffers. align: segment
    padding of a ContiguousLayout. The EP group, rank and size default to moeserve.parallel.state. fp8_quantize: the
    experts take FP8 layouts, and the low-latency mode dispatches x quantized by it (the other backends send x's
    dtype)."""
    if ep_size is None:
        from moeserve.parallel.state import get_parallel_state

        ps = get_parallel_state()
        ep_group, ep_rank, ep_size = ps.ep_group, ps.ep_rank, ps.ep_size
    kind = resolve_backend(options.backend, ep_size)
    if kind == "none":
        if num_local_experts != num_experts:
            raise ValueError(
                f"--moe-a2a-backend none keeps every expert on one rank, but this rank holds {num_local_experts} "
                f"of {num_experts}; choose allgather or all2all for expert parallelism")
        return LocalDispatcher(num_experts, align=align, dtype=dtype, device=device)
    if num_experts % ep_size or num_local_experts != num_experts // ep_size:
        raise ValueError(f"{num_experts} physical experts over ep_size {ep_size} is not {num_local_experts} per rank")
    if hidden_size is None or top_k is None:
        raise ValueError(f"--moe-a2a-backend {kind} needs hidden_size and top_k")
    common = dict(num_experts=num_experts, hidden_size=hidden_size, dtype=dtype, device=device, ep_group=ep_group,
                  ep_rank=ep_rank, ep_size=ep_size, align=align)
    if kind == "symm" and (why := symm_unavailable(device, ep_group)) is not None:
        if why not in _WARNED:
            _WARNED.add(why)
            logger.warning("--moe-a2a-backend symm falls back to all2all (the same modes over all-to-all): %s", why)
        kind = "all2all"
    if kind in ("all2all", "symm"):
        return BACKENDS[kind](**common, topk=top_k, deepep_mode=options.deepep_mode,
                              max_tokens_per_rank=options.max_tokens_per_rank, fp8_quantize=fp8_quantize)
    return BACKENDS[kind](**common)
