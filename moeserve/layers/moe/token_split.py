"""Attention TP with EP: the ranks of an attention group hold the same tokens, so each sends only its share through
the dispatcher and the group all-gathers the results (else every token-expert pair is computed tp times)."""

from __future__ import annotations

import torch

from moeserve.parallel.comm import all_gather
from moeserve.parallel.state import ParallelState


class TokenSplit:
    """This rank's share of its attention group's tokens: rows [rank * chunk, (rank + 1) * chunk), chunk = ceil(T /
    size). Inactive (every rank takes all rows) without attention TP or without EP."""

    def __init__(self, ps: ParallelState):
        self.size, self.rank, self.group = ps.attn_tp_size, ps.attn_tp_rank, ps.attn_tp_group
        self.active = ps.attn_tp_size > 1 and ps.ep_size > 1

    def rows(self, num_tokens: int) -> slice:
        if not self.active:
            return slice(0, num_tokens)
        chunk = -(-num_tokens // self.size)
        return slice(min(num_tokens, self.rank * chunk), min(num_tokens, (self.rank + 1) * chunk))

    def own(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ...] -> this rank's rows of it."""
        return x[self.rows(x.shape[0])] if self.active else x

    def gather(self, y: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """[own rows, H] on each rank of the group -> [num_tokens, H] on all of them."""
        if not self.active or num_tokens == 0:  # (a whole group is idle together: its ranks run the same batch)
            return y
        chunk = -(-num_tokens // self.size)
        if y.shape[0] < chunk:
            y = torch.cat([y, y.new_zeros(chunk - y.shape[0], y.shape[1])])
        return all_gather(y, self.group)[:num_tokens]
