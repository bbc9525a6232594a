"""Expert-parallel dispatchers: move tokens to the ranks holding their experts and the results back.

`make_dispatcher` is the one place that picks a backend (ServerArgs.moe_a2a_backend):
- none:      LocalDispatcher, every expert on this rank (ep_size 1). With ep_size > 1, `none` means allgather
             (the closest analogue of SGLang's default all-reduce MoE path: every rank sees every token).
- allgather: every rank sees every token, runs its own experts, reduce-scatter (the simple oracle)
- all2all:   torch.distributed all-to-all; ServerArgs.deepep_mode picks normal, low_latency or auto (per step)
Each MoE layer owns one dispatcher (dispatch/combine keep state between their a and b halves).

The EP backends allocate buffers of the activation dtype on the activation device, which are not known while the
model is built (on 'meta', before the loader resolves the dtype). Unless `dtype` and `device` are given, the EP
dispatcher is therefore built on the first `dispatch_a`, from x's dtype and device (the same on every rank, and
the first call happens on every rank in the same step: MoE layers are collective, IDLE ranks included).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from moeserve.core.layouts import ContiguousLayout, Dispatcher, MaskedLayout

if TYPE_CHECKING:
    from moeserve.args import ServerArgs
    from moeserve.core.forward_batch import ForwardBatch

__all__ = ["ContiguousLayout", "Dispatcher", "MaskedLayout", "make_dispatcher", "resolve_backend"]

BACKENDS = ("none", "allgather", "all2all")


def resolve_backend(kind: str, ep_size: int) -> str:
    """The backend that runs: `none` with ep_size > 1 is allgather."""
    if kind not in BACKENDS:
        raise ValueError(f"unknown MoE dispatch backend {kind!r}; choose none, allgather or all2all")
    return "allgather" if kind == "none" and ep_size > 1 else kind


class _LazyDispatcher:
    """Builds the real dispatcher on the first dispatch_a (x's dtype and device), then delegates to it."""

    def __init__(self, build):
        self._build = build
        self.inner: Any = None
        self._key: tuple | None = None  # (dtype, device) the inner dispatcher was built for

    def prepare(self, dtype: torch.dtype, device: torch.device | str) -> None:
        """Build the real dispatcher now (its buffers allocated) for activations of this dtype and device; a first
        dispatch_a with the same dtype and device then reuses it. No communication: safe on one rank alone."""
        key = (dtype, torch.device(device))
        if self._key != key:
            self.inner, self._key = self._build(dtype, key[1]), key

    def dispatch_a(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   batch: ForwardBatch | None = None) -> None:
        self.prepare(x.dtype, x.device)
        self.inner.dispatch_a(x, topk_ids, topk_weights, batch)

    def dispatch_b(self):
        return self.inner.dispatch_b()

    def combine_a(self, expert_out: torch.Tensor) -> None:
        self.inner.combine_a(expert_out)

    def combine_b(self) -> torch.Tensor:
        return self.inner.combine_b()

    def buffer_bytes(self) -> int:
        fn = getattr(self.inner, "buffer_bytes", None)
        return fn() if fn is not None else 0

    @property
    def comm_bytes(self) -> dict[str, int]:
        return self.inner.comm_bytes if self.inner is not None else {"dispatch": 0, "combine": 0}

    @property
    def last_mode(self) -> str | None:
        return getattr(self.inner, "last_mode", None)


def make_dispatcher(server_args_or_kind: ServerArgs | str, num_experts: int, num_local_experts: int, *,
                    hidden_size: int | None = None, top_k: int | None = None, align: int = 1,
                    dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                    deepep_mode: str | None = None, max_tokens_per_rank: int | None = None,
                    ep_group: Any = None, ep_rank: int | None = None, ep_size: int | None = None) -> Dispatcher:
    """A dispatcher for one MoE layer.

    num_experts: physical experts over all EP ranks; num_local_experts: those on this rank. hidden_size and top_k
    size the EP backends' buffers. align: segment padding of a ContiguousLayout. The EP group, rank and size default
    to moeserve.parallel.state.get_parallel_state(); deepep_mode and max_tokens_per_rank to the ServerArgs
    (deepep_mode, ep_max_tokens_per_rank) when one is passed. Without dtype and device the EP dispatcher is built
    on the first dispatch_a (see the module doc).
    """
    from moeserve.parallel.state import get_parallel_state

    args = None if isinstance(server_args_or_kind, str) else server_args_or_kind
    kind = server_args_or_kind if args is None else args.moe_a2a_backend
    if ep_size is None:
        ps = get_parallel_state()
        ep_group, ep_rank, ep_size = ps.ep_group, ps.ep_rank, ps.ep_size
    kind = resolve_backend(kind, ep_size)
    if kind == "none":
        if num_local_experts != num_experts:
            raise ValueError(
                f"--moe-a2a-backend none keeps every expert on one rank, but this rank holds {num_local_experts} "
                f"of {num_experts}; choose allgather or all2all for expert parallelism"
            )
        from moeserve.ep.local import LocalDispatcher

        return LocalDispatcher(num_experts, align=align)

    if num_experts % ep_size or num_local_experts != num_experts // ep_size:
        raise ValueError(f"{num_experts} physical experts over ep_size {ep_size} is not {num_local_experts} per rank")
    if hidden_size is None:
        raise ValueError(f"--moe-a2a-backend {kind} needs hidden_size")
    if deepep_mode is None:
        deepep_mode = args.deepep_mode if args is not None else "auto"
    if max_tokens_per_rank is None:
        max_tokens_per_rank = args.ep_max_tokens_per_rank if args is not None else 128
    if kind == "all2all":
        from moeserve.ep.all2all_auto import resolve_deepep_mode

        resolve_deepep_mode(deepep_mode, None)  # a bad name fails now, not at the first forward
        if top_k is None:
            raise ValueError("--moe-a2a-backend all2all needs top_k")

    def build(dt: torch.dtype, dev: torch.device | str):
        common = dict(num_experts=num_experts, hidden_size=hidden_size, dtype=dt, device=dev,
                      ep_group=ep_group, ep_rank=ep_rank, ep_size=ep_size)
        if kind == "allgather":
            from moeserve.ep.allgather import AllGatherDispatcher

            return AllGatherDispatcher(**common, align=align)
        from moeserve.ep.all2all_auto import AutoDispatcher

        return AutoDispatcher(**common, topk=top_k, deepep_mode=deepep_mode,
                              max_tokens_per_rank=max_tokens_per_rank, align=align)

    if dtype is not None and device is not None:
        return build(dtype, device)
    return _LazyDispatcher(build)
