"""The FP8 twin of the dense SwiGLU MLP (layers/mlp.py), for dense layers and shared experts.

    y = W_down · (silu(W_gate x) * (W_up x)),  each W in e4m3 with one float32 scale per 128 x 128 block

gate_proj and up_proj stay fused in one [2I', H] weight, each part padded with zero rows to I' = whole blocks of
128 (I' = I when I is a multiple of 128, as in DeepSeek-V3), so that each part's scale rows sit on block boundaries;
down_proj is [H, I'] with zero columns past I. The padding is exact: its gate and up outputs are 0, silu(0) * 0 = 0,
and the zero columns of down_proj see only those zeros (and do not change a group's amax when the activations are
quantized). On the CPU the layer keeps its weights dequantized as well (see fp8_linear.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.kernels.activation import silu_and_mul
from moeserve.kernels.fp8_gemm import fp8_linear
from moeserve.kernels.fp8_quant import (
    BLOCK,
    FP8_DTYPE,
    dequantize_weight,
    fake_quantize_activations,
    num_blocks,
)
from moeserve.layers.mlp import GatedMLP
from moeserve.layers.quantization.fp8_linear import SCALE_SUFFIX
from moeserve.layers.weights import WeightSpec, block_slice


def fp8_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=FP8_DTYPE), requires_grad=False)


def scale_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)


def check_tp_blocks(what: str, layer: GatedMLP | nn.Module) -> None:
    """A tensor-parallel MoE splits I on whole 128-row scale blocks (a block has one scale), or is refused."""
    if layer.tp_size > 1 and layer.intermediate_size % BLOCK:
        raise ValueError(f"FP8 weights: a tensor-parallel MoE (--ep-size 1) splits {what}' intermediate size "
                         f"{layer.full_intermediate_size} into {layer.intermediate_size} rows a rank, not whole "
                         f"{BLOCK}-row scale blocks: choose a --tp-size that does, or --ep-size equal to --tp-size")


class Fp8GatedMLP(GatedMLP):
    """gate_up_proj [2I', H] e4m3 + gate_up_proj_scale_inv [2I'/128, ceil(H/128)], down_proj [H, I'] e4m3 +
    down_proj_scale_inv [ceil(H/128), I'/128]; checkpoint keys as DeepSeek's (`*.weight`, `*.weight_scale_inv`)."""

    fp32_params = ("gate_up_proj_scale_inv", "down_proj_scale_inv")

    def __init__(self, hidden_size: int, intermediate_size: int, activation_dtype: torch.dtype = torch.float32,
                 tp_size: int = 1, tp_rank: int = 0):
        super().__init__(hidden_size, intermediate_size, tp_size, tp_rank)
        check_tp_blocks("the shared experts", self)
        self.activation_dtype = activation_dtype
        self._dense: tuple[torch.Tensor, torch.Tensor] | None = None  # CPU: (gate_up, down) dequantized
        H, inter = hidden_size, self.intermediate_size
        self.padded_intermediate = ip = num_blocks(inter) * BLOCK
        self.gate_up_proj = fp8_param(2 * ip, H)
        self.gate_up_proj_scale_inv = scale_param(2 * ip // BLOCK, num_blocks(H))
        self.down_proj = fp8_param(H, ip)
        self.down_proj_scale_inv = scale_param(num_blocks(H), ip // BLOCK)
        self.padding_numel = {"gate_up_proj": 2 * (ip - inter) * H, "down_proj": H * (ip - inter)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._dense is not None:
            gate_up, down = self._dense
            h = silu_and_mul(F.linear(fake_quantize_activations(x), gate_up))
            return F.linear(fake_quantize_activations(h), down)
        h = fp8_linear(x, self.gate_up_proj, self.gate_up_proj_scale_inv)  # [T, 2I'], 0 past I in each half
        # the down projection's input silu(gate) * up, quantized on its way in
        return fp8_linear(h, self.down_proj, self.down_proj_scale_inv, silu=True)

    def process_weights_after_loading(self, device: torch.device) -> None:
        self._dense = None
        if torch.device(device).type == "cpu":
            self._dense = (dequantize_weight(self.gate_up_proj, self.gate_up_proj_scale_inv, self.activation_dtype),
                           dequantize_weight(self.down_proj, self.down_proj_scale_inv, self.activation_dtype))

    def expert_slots(self, n: int) -> dict[str, torch.Tensor]:
        """As GatedMLP.expert_slots, in FP8 with the scales: each slot's gate and up padded to whole blocks like a
        routed FP8 expert's. The slots' rows (and down's columns) must fall on scale blocks: one slot always does,
        several only with I / n a multiple of 128 (DeepSeek-V3's 2,048; V2-Lite's 1,408)."""
        inter, ip = self.intermediate_size // n, self.padded_intermediate
        if n == 1:
            return {"w13": self.gate_up_proj.data[None], "w13_scale_inv": self.gate_up_proj_scale_inv.data[None],
                    "w2": self.down_proj.data[None], "w2_scale_inv": self.down_proj_scale_inv.data[None]}
        if inter % BLOCK:
            raise ValueError(f"--enable-shared-experts-fusion with FP8 weights: {n} shared experts of intermediate "
                             f"{inter} do not split on the 128 x 128 scale blocks (run without the flag)")
        H, b = self.hidden_size, inter // BLOCK
        gate, up = self.gate_up_proj.data[:ip].view(n, inter, H), self.gate_up_proj.data[ip:].view(n, inter, H)
        gs = self.gate_up_proj_scale_inv.data
        gate_s, up_s = gs[: ip // BLOCK].view(n, b, -1), gs[ip // BLOCK:].view(n, b, -1)
        hb = self.down_proj_scale_inv.shape[0]
        return {"w13": torch.cat((gate, up), dim=1), "w13_scale_inv": torch.cat((gate_s, up_s), dim=1),
                "w2": self.down_proj.data.view(H, n, inter).transpose(0, 1),
                "w2_scale_inv": self.down_proj_scale_inv.data.view(hb, n, b).transpose(0, 1)}

    def weight_specs(self, prefix: str) -> Iterator[WeightSpec]:
        inter, H, ip = self.intermediate_size, self.hidden_size, self.padded_intermediate
        full, rows = self.full_intermediate_size, self.rows  # rows of I (whole blocks) in a tensor-parallel MoE
        fb, hb, ib, block_rows = num_blocks(full), num_blocks(H), num_blocks(inter), block_slice(rows, full, BLOCK)
        for name, start in (("gate_proj", 0), ("up_proj", ip)):
            yield WeightSpec(f"{prefix}.{name}.weight", (full, H), f"{prefix}.gate_up_proj", src=(rows,),
                             dst=(slice(start, start + inter),))
            yield WeightSpec(f"{prefix}.{name}.weight{SCALE_SUFFIX}", (fb, hb), f"{prefix}.gate_up_proj_scale_inv",
                             src=(block_rows,), dst=(slice(start // BLOCK, start // BLOCK + ib),))
        yield WeightSpec(f"{prefix}.down_proj.weight", (H, full), f"{prefix}.down_proj", src=(slice(None), rows),
                         dst=(slice(None), slice(0, inter)))
        yield WeightSpec(f"{prefix}.down_proj.weight{SCALE_SUFFIX}", (hb, fb), f"{prefix}.down_proj_scale_inv",
                         src=(slice(None), block_rows))
