"""FP8 twins of the linear layers (layers/linear.py): the weight in e4m3 [out, in] and `weight_scale_inv` float32
[ceil(out/128), ceil(in/128)], one scale per 128 x 128 block, as DeepSeek's checkpoints store them.

    y = fp8_linear(x, W, scale_inv)  (x quantized per token in groups of 128 on the fly; kernels/fp8_gemm.py)
    y = fp8_gemm(q, scale, W, scale_inv)  (x handed over already quantized, QuantizedRows: by the norm before)

On the CPU (development and tests; it has no FP8 matmul) each layer also keeps W dequantized in the activations'
dtype, made once after loading: y = fake_quantize(x) W^T is the torch reference's math (activations rounded through
FP8, dequantized weights) without dequantizing W at every step. That copy is not a parameter and is not counted in
the weight bytes; CUDA holds none.

The checkpoint keys are the plain layer's plus `<prefix>.weight_scale_inv`. A parallel layer's share of the scales
follows its share of the weight in whole blocks, so a share must start and end on a block boundary (or at the end
of the dimension); `to_fp8` (fp8.py) checks this with the layer's name before building the twin.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.kernels.fp8_gemm import fp8_gemm, fp8_linear
from moeserve.kernels.fp8_quant import (
    BLOCK,
    FP8_DTYPE,
    QuantizedRows,
    dequantize_weight,
    fake_quantize_activations,
    num_blocks,
)
from moeserve.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from moeserve.layers.weights import WeightSpec, block_slice

SCALE_SUFFIX = "_scale_inv"  # DeepSeek: `<name>.weight` -> `<name>.weight_scale_inv`


class _Fp8Weight:
    """What the three FP8 twins share: the e4m3 weight and its block scales, the matmul, the dense view."""

    fp32_params = ("weight_scale_inv",)  # the loader keeps this float32 (the e4m3 weight keeps its dtype too)
    weight: nn.Parameter
    weight_scale_inv: nn.Parameter
    _dense: torch.Tensor | None = None  # CPU only: W dequantized (see the module doc)
    activation_dtype: torch.dtype = torch.float32

    def _make_fp8(self, activation_dtype: torch.dtype) -> None:
        self.activation_dtype = activation_dtype
        out, inp = self.weight.shape
        self.weight = nn.Parameter(torch.empty(out, inp, dtype=FP8_DTYPE), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(num_blocks(out), num_blocks(inp), dtype=torch.float32),
                                             requires_grad=False)

    def _matmul(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        """x W^T; x may come quantized already (QuantizedRows, from the norm before the layer)."""
        if isinstance(x, QuantizedRows):
            if self._dense is not None:
                return F.linear(x.dequantize(self.activation_dtype), self._dense)
            q, s = x.q.reshape(-1, x.q.shape[-1]), x.scale.reshape(-1, x.scale.shape[-1])
            return fp8_gemm(q, s, self.weight, self.weight_scale_inv, self.activation_dtype).view(
                *x.q.shape[:-1], self.weight.shape[0])
        if self._dense is not None:
            return F.linear(fake_quantize_activations(x), self._dense)
        return fp8_linear(x, self.weight, self.weight_scale_inv)

    def process_weights_after_loading(self, device: torch.device) -> None:
        self._dense = self.dense_weight(self.activation_dtype) if torch.device(device).type == "cpu" else None

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """W dequantized [out, in] in `dtype` (a copy)."""
        return dequantize_weight(self.weight, self.weight_scale_inv, dtype)


class Fp8Linear(_Fp8Weight, Linear):
    """Replicated; the default weight specs (key = parameter name) cover weight, weight_scale_inv and bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 activation_dtype: torch.dtype = torch.float32):
        super().__init__(in_features, out_features, bias)
        self._make_fp8(activation_dtype)


class Fp8ColumnParallelLinear(_Fp8Weight, ColumnParallelLinear):
    """Output rows `rows` of the full weight, and the scale rows that cover them."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, rows: slice | None = None,
                 activation_dtype: torch.dtype = torch.float32):
        super().__init__(in_features, out_features, bias, rows=rows)
        self._make_fp8(activation_dtype)

    def weight_specs(self, prefix: str) -> Iterator[WeightSpec]:
        yield from super().weight_specs(prefix)
        n, k = self.full_out_features, self.in_features
        yield WeightSpec(f"{prefix}.weight{SCALE_SUFFIX}", (num_blocks(n), num_blocks(k)), f"{prefix}.weight_scale_inv",
                         src=(block_slice(self.rows, n, BLOCK),))


class Fp8RowParallelLinear(_Fp8Weight, RowParallelLinear):
    """Input columns `cols` of the full weight, and the scale columns that cover them."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_size: int = 1, tp_rank: int = 0,
                 group: object = None, activation_dtype: torch.dtype = torch.float32):
        super().__init__(in_features, out_features, bias, tp_size, tp_rank, group)
        self._make_fp8(activation_dtype)

    def weight_specs(self, prefix: str) -> Iterator[WeightSpec]:
        yield from super().weight_specs(prefix)
        n, k = self.out_features, self.full_in_features
        yield WeightSpec(f"{prefix}.weight{SCALE_SUFFIX}", (num_blocks(n), num_blocks(k)), f"{prefix}.weight_scale_inv",
                         src=(slice(None), block_slice(self.cols, k, BLOCK)))


def fp8_twin(layer: Linear, activation_dtype: torch.dtype) -> Linear:
    """The FP8 twin of a plain linear layer, with the same shapes and the same share of the checkpoint tensor.
    Raises ValueError when a parallel layer's share does not fall on block boundaries."""
    bias = layer.bias is not None
    if isinstance(layer, ColumnParallelLinear):
        block_slice(layer.rows, layer.full_out_features, BLOCK)
        return Fp8ColumnParallelLinear(layer.in_features, layer.full_out_features, bias, rows=layer.rows,
                                       activation_dtype=activation_dtype)
    if isinstance(layer, RowParallelLinear):
        block_slice(layer.cols, layer.full_in_features, BLOCK)
        tp_size = layer.full_in_features // layer.in_features
        return Fp8RowParallelLinear(layer.full_in_features, layer.out_features, bias, tp_size,
                                    layer.cols.start // layer.in_features, layer.group, activation_dtype)
    return Fp8Linear(layer.in_features, layer.out_features, bias, activation_dtype)
