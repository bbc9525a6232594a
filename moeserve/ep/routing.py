"""Routing helpers shared by every dispatcher: where each (token, top-k slot) pair goes, and in which row.

Vocabulary:
- a *pair* is one (row, slot) of a `topk_ids [N, k]` table; slot value -1 means masked (no expert), skipped.
- a *row* is a token as a dispatcher moved it; rows can reach a rank once although several of their experts live
  there (DeepEP's deduplication), so a row carries `k` local expert ids, -1 where the expert lives elsewhere.
- physical expert `e` lives on rank `e // num_local_experts` as local expert `e % num_local_experts`.

All functions are pure tensor code except `max_tokens_over_ranks` (the one agreement between ranks). Two layout
families:
- contiguous (normal mode, allgather, single rank): `plan_contiguous` sorts pairs by local expert (reading the row
  count back to the host, or with `static=True` sized by an upper bound, sync-free), `scatter_contiguous` builds
  the ContiguousLayout and `combine_contiguous` returns each row's weighted sum.
- masked (low-latency mode): `plan_masked` places rows into `[E_local, C, H]` with static shapes only, no host
  sync, so it can be captured in a CUDA graph; `scatter_masked` and `combine_masked` move the rows.
Weights: the combine helpers apply the top-k weights (on the rank that ran the experts) and sum in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moeserve.core.layouts import ContiguousLayout
from moeserve.kernels.moe_combine import moe_combine

if TYPE_CHECKING:
    from moeserve.core.forward_batch import ForwardBatch

# ---------------------------------------------------------------------------------------------------------------
# Placement and the one agreement between ranks


def num_local_experts(num_experts: int, ep_size: int) -> int:
    """Experts per rank; raises when the physical experts do not split evenly over the EP ranks."""
    if ep_size < 1 or num_experts % ep_size:
        raise ValueError(f"{num_experts} physical experts do not split over --ep-size {ep_size}: use a multiple "
                         "of the EP size (add redundant experts with --ep-num-redundant-experts)")
    return num_experts // ep_size


def max_tokens_over_ranks(batch: ForwardBatch | None, num_tokens: int, group: dist.ProcessGroup | None,
                          device: torch.device | str = "cpu") -> int:
    """An upper bound on any EP rank's token count this step, the same on every rank.

    From the lock-step header `batch.global_num_tokens` when it is there (no communication: per-DP-rank counts
    bound every EP rank's count); otherwise an all-reduce MAX, which syncs the host and cannot be captured."""
    if batch is not None and batch.global_num_tokens:
        bound = max(batch.global_num_tokens)
        # A runner that pads T (to a CUDA-graph size) must put the padded counts in the header too.
        assert num_tokens <= bound, f"{num_tokens} tokens on this rank, global_num_tokens says at most {bound}"
        return bound
    t = torch.tensor([num_tokens], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


# ---------------------------------------------------------------------------------------------------------------
# Ranks and local ids (static shapes)


def expert_rank(topk_ids: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """[N, k] int64: the rank that holds each pair's expert, -1 for masked slots."""
    return torch.where(topk_ids >= 0, topk_ids.div(num_local_experts, rounding_mode="floor"), -1)


def token_rank_mask(topk_ids: torch.Tensor, num_local_experts: int, num_ranks: int) -> torch.Tensor:
    """[N, R] bool: row n has at least one expert on rank r (DeepEP's `is_token_in_rank`)."""
    ranks = expert_rank(topk_ids, num_local_experts)
    hit = torch.zeros(topk_ids.shape[0], num_ranks + 1, dtype=torch.bool, device=topk_ids.device)
    hit.scatter_(1, torch.where(ranks >= 0, ranks, num_ranks), True)  # masked slots land in the spare column
    return hit[:, :num_ranks]


def local_topk(topk_ids: torch.Tensor, topk_weights: torch.Tensor, rank: int | torch.Tensor,
               num_local_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The view of `rank`: local expert ids [..., k] int64 (-1 where the expert lives elsewhere or the slot is
    masked) and the weights [..., k] fp32 with those slots zeroed. `rank` may be a tensor that broadcasts."""
    first = rank * num_local_experts
    mine = (topk_ids >= first) & (topk_ids < first + num_local_experts)
    ids = torch.where(mine, topk_ids - first, -1)
    weights = torch.where(mine, topk_weights.float(), 0.0)
    return ids, weights


def pack_meta(local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[..., 2k] int32: local ids then the fp32 weights' bits, so one collective carries both."""
    return torch.cat([local_ids.to(torch.int32), weights.float().contiguous().view(torch.int32)], dim=-1)


def unpack_meta(meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack_meta`: (local ids [..., k] int64, weights [..., k] fp32)."""
    k = meta.shape[-1] // 2
    return meta[..., :k].long(), meta[..., k:].contiguous().view(torch.float32)


def aligned_offsets(counts: torch.Tensor, align: int) -> torch.Tensor:
    """[E + 1] int64 segment starts when each of `counts [E]` rows is padded up to a multiple of `align`."""
    padded = (counts + align - 1) // align * align
    offsets = torch.zeros(counts.shape[0] + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(padded, 0, out=offsets[1:])
    return offsets


# ---------------------------------------------------------------------------------------------------------------
# Contiguous layout (normal mode, allgather, single rank)


@dataclass
class ContiguousPlan:
    """Where each pair's row goes in a ContiguousLayout of M rows. P pairs: the valid ones, or (static) all N*k."""

    pair_row: torch.Tensor  # [P] int64, source row of each pair, pairs sorted by (local expert, row, slot)
    pair_dest: torch.Tensor  # [P] int64, row of the pair in the layout; M (a spare row) for an invalid pair
    pair_weight: torch.Tensor  # [P] fp32, the pair's top-k weight, 0 for an invalid pair
    offsets: torch.Tensor  # [E_local + 1] int64, aligned segment starts
    counts: torch.Tensor  # [E_local] int64, valid rows per expert
    num_rows: int  # M: offsets[-1], or (static) the bound N*k + E_local*(align-1) >= offsets[-1]
    pair_valid: torch.Tensor | None = None  # [P] bool (static plans only; None: every pair is valid)


def plan_contiguous(local_ids: torch.Tensor, weights: torch.Tensor, num_local_experts: int,
                    align: int = 1, *, static: bool = False) -> ContiguousPlan:
    """Sort the valid pairs of `local_ids [N, k]` (-1 = skip) by local expert, stable in (row, slot) order.

    One row per valid pair: a row that names the same expert twice gets two rows in that segment, each with its
    own weight. By default M = offsets[-1] is read back to the host (a sync; normal mode syncs anyway).
    `static`: no host sync, shapes from N and k only (CUDA-graph safe): the layout gets the upper bound of rows,
    rows past offsets[-1] are zero, and invalid pairs travel along aimed at a spare row. Worth it when most pairs
    are valid (a single rank); with many ranks most rows would be dead weight for the experts."""
    assert align >= 1
    k = local_ids.shape[1]
    e = num_local_experts
    flat = local_ids.reshape(-1).long()
    device = local_ids.device
    if static:
        experts_sorted, pair = torch.sort(torch.where(flat >= 0, flat, e), stable=True)  # invalid pairs last
    else:
        valid = torch.nonzero(flat >= 0).squeeze(1)  # [P], in (row, slot) order
        experts_sorted, order = torch.sort(flat[valid], stable=True)
        pair = valid[order]
    counts = torch.zeros(e + 1, dtype=torch.int64, device=device)  # the last slot counts invalid pairs
    counts.scatter_add_(0, experts_sorted, torch.ones_like(experts_sorted))
    counts = counts[:e]
    offsets = aligned_offsets(counts, align)
    unpadded_start = torch.cumsum(counts, 0) - counts
    expert = experts_sorted.clamp(max=e - 1)
    dest = offsets[expert] + torch.arange(pair.shape[0], device=device) - unpadded_start[expert]
    pair_weight = weights.reshape(-1)[pair].float()
    pair_valid = None
    if static:
        num_rows = flat.shape[0] + e * (align - 1)
        pair_valid = experts_sorted < e
        dest = torch.where(pair_valid, dest, num_rows)
        pair_weight = torch.where(pair_valid, pair_weight, 0.0)
    else:
        num_rows = int(offsets[-1])
    return ContiguousPlan(pair_row=pair // k, pair_dest=dest, pair_weight=pair_weight, offsets=offsets,
                          counts=counts, num_rows=num_rows, pair_valid=pair_valid)


def scatter_contiguous(rows: torch.Tensor, plan: ContiguousPlan) -> ContiguousLayout:
    """Build the layout from `rows [N, H]`. Padding rows are zero."""
    x = rows.new_zeros(plan.num_rows + (plan.pair_valid is not None), rows.shape[1])  # static: + a spare row
    x.index_copy_(0, plan.pair_dest, rows.index_select(0, plan.pair_row))
    return ContiguousLayout(x=x[: plan.num_rows], expert_offsets=plan.offsets.to(torch.int32),
                            num_tokens_per_expert=plan.counts.to(torch.int32))


def combine_contiguous(expert_out: torch.Tensor, plan: ContiguousPlan, num_rows: int) -> torch.Tensor:
    """[num_rows, H] fp32: sum over each row's pairs of weight * expert_out[pair's layout row].

    Reads only valid layout rows, so padding rows of `expert_out` may hold anything (NaN included)."""
    out = torch.zeros(num_rows, expert_out.shape[1], dtype=torch.float32, device=expert_out.device)
    dest = plan.pair_dest if plan.pair_valid is None else torch.where(plan.pair_valid, plan.pair_dest, 0)
    weighted = expert_out.index_select(0, dest).float().mul_(plan.pair_weight[:, None])
    if plan.pair_valid is not None:
        weighted.masked_fill_(~plan.pair_valid[:, None], 0.0)  # NaN * 0 would be NaN: fill, not multiply
    out.index_add_(0, plan.pair_row, weighted)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Masked layout (low-latency mode): static shapes, no host sync


def dedupe_topk(local_ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge repeated experts within a row: (valid [N, k] bool, merged weights [N, k] fp32).

    `valid` is true on the first slot naming each local expert; its weight becomes the sum of the weights of all
    slots naming it (w1 f(x) + w2 f(x) = (w1 + w2) f(x)), so each expert sees a row at most once. Static shapes."""
    k = local_ids.shape[-1]
    same = local_ids.unsqueeze(-1) == local_ids.unsqueeze(-2)  # [N, k, k]
    earlier = torch.ones(k, k, dtype=torch.bool, device=local_ids.device).tril(-1)
    valid = (local_ids >= 0) & ~(same & earlier).any(-1)
    merged = (same * weights.float().unsqueeze(-2)).sum(-1)
    return valid, torch.where(valid, merged, 0.0)


@dataclass
class MaskedPlan:
    """Where each row's (deduplicated) pairs go in a MaskedLayout of capacity C rows per expert. N rows."""

    valid: torch.Tensor  # [N, k] bool, the pair is placed (first slot of its expert, not masked)
    dest: torch.Tensor  # [N, k] int64, flat row l * C + position in the layout; E_local * C (a spare) if not valid
    weight: torch.Tensor  # [N, k] fp32, merged weight, 0 where not valid


def plan_masked(local_ids: torch.Tensor, weights: torch.Tensor, num_local_experts: int, capacity: int,
                filled: torch.Tensor) -> MaskedPlan:
    """Place rows after the `filled [E_local]` rows each expert already holds; adds this batch's rows to `filled`
    in place. Row order is kept within each expert. The caller guarantees no expert overflows `capacity`."""
    local_ids = local_ids.long()
    valid, merged = dedupe_topk(local_ids, weights)
    n = local_ids.shape[0]
    spare = num_local_experts
    col = torch.where(valid, local_ids, spare)
    hits = torch.zeros(n, num_local_experts + 1, dtype=torch.int64, device=local_ids.device)
    hits.scatter_(1, col, 1)  # deduplicated: at most one valid hit per (row, expert)
    hits = hits[:, :num_local_experts]
    position = torch.cumsum(hits, 0) - hits + filled  # [N, E_local], row n's position in each expert
    filled += hits.sum(0)
    pos = torch.gather(position, 1, col.clamp(max=num_local_experts - 1))
    dest = torch.where(valid, local_ids.clamp(min=0) * capacity + pos, num_local_experts * capacity)
    return MaskedPlan(valid=valid, dest=dest, weight=merged)


def scatter_masked(rows: torch.Tensor, plan: MaskedPlan, x_flat: torch.Tensor) -> None:
    """Copy `rows [N, H]` into `x_flat [E_local * C + 1, H]` (the last row is a spare that takes invalid pairs)."""
    for j in range(plan.dest.shape[1]):
        x_flat.index_copy_(0, plan.dest[:, j], rows)


def combine_masked(out_flat: torch.Tensor, plan: MaskedPlan) -> torch.Tensor:
    """[N, H] fp32: per row, sum of merged weight * expert output over its valid pairs. `out_flat [E_local * C, H]`;
    rows past masked_m may hold anything (NaN included): they are never read into the sum. One gather-and-sum
    pass (moeserve/kernels/moe_combine.py; Triton on CUDA)."""
    return moe_combine(out_flat, torch.where(plan.valid, plan.dest, -1), plan.weight, torch.float32)
