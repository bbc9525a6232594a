"""What a dispatcher hands the experts: this rank's tokens grouped by local expert, in one of two layouts."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ContiguousLayout:
    """Normal mode: tokens for this rank's experts, grouped by local expert, each segment padded to `align` rows.

    The rows are either in x itself or, with `pairs`, named in it: row r is token pairs[r] // top_k of x (the
    single-rank dispatcher's, so the first grouped GEMM gathers its rows itself and no [M, H] copy is made)."""

    x: torch.Tensor  # [M, H] the layout rows; with `pairs`, the tokens [T, H] they come from
    expert_offsets: torch.Tensor  # [E_local + 1] int32, segment starts (segment e is rows offsets[e]:offsets[e+1])
    num_tokens_per_expert: torch.Tensor  # [E_local] int32, valid rows at the start of each segment
    pairs: torch.Tensor | None = None  # [M] int32: row r holds (token, slot) pair pairs[r] (-1: a padding row)
    top_k: int = 1  # pairs per token
    padded: bool = False  # some rows may be padding (pairs -1): they are zeros

    @property
    def num_rows(self) -> int:
        return int(self.x.shape[0] if self.pairs is None else self.pairs.shape[0])

    def rows(self) -> torch.Tensor:
        """The layout rows [M, H]: x, or gathered from it."""
        return self.x if self.pairs is None else gather_rows(self.x, self.pairs, self.top_k, self.padded)


def gather_rows(tokens: torch.Tensor, pairs: torch.Tensor, top_k: int, padded: bool = True) -> torch.Tensor:
    """[M, H]: row r is tokens[pairs[r] // top_k], zeros where pairs[r] is -1 (only looked for when padded)."""
    src = pairs.long()
    if not padded:
        return tokens.index_select(0, src // top_k)
    return tokens.index_select(0, src.clamp(min=0) // top_k).masked_fill_((src < 0)[:, None], 0)


@dataclass
class MaskedLayout:
    """Low-latency mode: static shapes, graph-capturable."""

    x: torch.Tensor  # [E_local, cap, H], the activations' dtype, or e4m3 when x_scale is given
    masked_m: torch.Tensor  # [E_local] int32, valid rows per expert
    # FP8 dispatch (low-latency mode with FP8 experts): x's scales [E_local, cap, ceil(H/128)] float32, one per token
    # and group of 128 (moeserve/kernels/fp8_quant.py); None: x is in the activations' dtype.
    x_scale: torch.Tensor | None = None

    def rows(self) -> torch.Tensor:
        """The rows in the layout's shape (as ContiguousLayout.rows): x."""
        return self.x
