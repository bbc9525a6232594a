"""Expert-parallel dispatchers: move tokens to the ranks holding their experts and the results back.

`make_dispatcher` is the one place that picks a backend (ServerArgs.moe_a2a_backend):
- none:      LocalDispatcher, every expert on this rank (ep_size 1)
- allgather: every rank sees every token, runs its own experts, reduce-scatter (the simple oracle) [later]
- all2all:   torch.distributed all-to-all, normal and low-latency modes [later]
Each MoE layer owns one dispatcher (dispatch/combine keep state between their a and b halves).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moeserve.ep.layouts import ContiguousLayout, Dispatcher, MaskedLayout

if TYPE_CHECKING:
    from moeserve.args import ServerArgs

__all__ = ["ContiguousLayout", "Dispatcher", "MaskedLayout", "make_dispatcher"]


def make_dispatcher(server_args_or_kind: ServerArgs | str, num_experts: int, num_local_experts: int, *,
                    hidden_size: int | None = None, top_k: int | None = None, align: int = 1,
                    **kwargs: Any) -> Dispatcher:
    """A dispatcher for one MoE layer.

    num_experts: physical experts over all EP ranks; num_local_experts: those on this rank. hidden_size, top_k and
    kwargs are for backends that preallocate buffers. align: segment padding of a ContiguousLayout.
    """
    kind = server_args_or_kind if isinstance(server_args_or_kind, str) else server_args_or_kind.moe_a2a_backend
    if kind == "none":
        if num_local_experts != num_experts:
            raise ValueError(
                f"--moe-a2a-backend none keeps every expert on one rank, but this rank holds {num_local_experts} "
                f"of {num_experts}; choose allgather or all2all for expert parallelism"
            )
        from moeserve.ep.local import LocalDispatcher

        return LocalDispatcher(num_experts, align=align)
    if kind in ("allgather", "all2all"):
        raise NotImplementedError(
            f"MoE dispatch backend {kind!r} is not implemented yet: add it in moeserve/ep/__init__.py "
            "make_dispatcher (it receives num_experts, num_local_experts, hidden_size, top_k, align)"
        )
    raise ValueError(f"unknown MoE dispatch backend {kind!r}; choose none, allgather or all2all")
