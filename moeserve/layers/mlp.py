"""Dense SwiGLU MLP (dense layers and shared experts), replicated on every rank (or, as the shared experts of a
tensor-parallel MoE, split over its ranks by rows of the intermediate dimension: the output is a partial sum).

    y = W_down · (silu(W_gate x) * (W_up x)),   with W_gate and W_up fused into one [2I, H] weight
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from moeserve.kernels.activation import silu_and_mul
from moeserve.kernels.skinny_gemm import skinny_gemm
from moeserve.layers.weights import WeightSpec, shard


class GatedMLP(nn.Module):
    """gate_up [2I, H] = [gate_proj; up_proj], down [H, I]; checkpoint keys gate_proj/up_proj/down_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        self.hidden_size = hidden_size
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.full_intermediate_size = intermediate_size  # in the checkpoint
        self.rows = shard(intermediate_size, tp_size, tp_rank)  # this rank's part of it
        self.intermediate_size = intermediate_size = intermediate_size // tp_size
        self.gate_up_proj = nn.Parameter(torch.empty(2 * intermediate_size, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(hidden_size, intermediate_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_gemm(silu_and_mul(skinny_gemm(x, self.gate_up_proj)), self.down_proj)

    def expert_slots(self, n: int) -> dict[str, torch.Tensor]:
        """This MLP as n experts of intermediate I / n, in the routed experts' parameters (w13 [n, 2I/n, H] as
        [gate_j; up_j], w2 [n, H, I/n]): sum_j down_j (silu(gate_j x) * up_j x) over its column blocks j is the
        MLP, exactly (--enable-shared-experts-fusion)."""
        inter, H = self.intermediate_size // n, self.hidden_size
        gate, up = self.gate_up_proj.data.view(2, n, inter, H).unbind(0)
        return {"w13": torch.cat((gate, up), dim=1), "w2": self.down_proj.data.view(H, n, inter).transpose(0, 1)}

    def weight_specs(self, prefix: str) -> Iterator[WeightSpec]:
        full, inter, H, rows = self.full_intermediate_size, self.intermediate_size, self.hidden_size, self.rows
        yield WeightSpec(f"{prefix}.gate_proj.weight", (full, H), f"{prefix}.gate_up_proj", src=(rows,),
                         dst=(slice(0, inter),))
        yield WeightSpec(f"{prefix}.up_proj.weight", (full, H), f"{prefix}.gate_up_proj", src=(rows,),
                         dst=(slice(inter, 2 * inter),))
        yield WeightSpec(f"{prefix}.down_proj.weight", (H, full), f"{prefix}.down_proj", src=(slice(None), rows))
