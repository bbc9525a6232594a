"""Linear layers: replicated, column-parallel (output features split) and row-parallel (input split + reduce).

Weights are [out, in] as in the checkpoint. Each parallel layer knows which part of the full checkpoint tensor
its rank holds and says so in `weight_specs`, so the loader reads only that part.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moeserve.kernels.skinny_gemm import skinny_gemm
from moeserve.layers.weights import WeightSpec, shard
from moeserve.parallel.comm import all_reduce


class Linear(nn.Module):
    """y = x W^T (+ b); W [out, in], the same on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x)
        return y + self.bias if self.bias is not None else y

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T without the bias: the one place a weight format (FP8, layers/quantization/) changes. (A decode
        batch of a few rows takes the GEMV, kernels/skinny_gemm.py.)"""
        return skinny_gemm(x, self.weight)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """W [out, in] as a plain matrix in `dtype` (for code that multiplies by parts of it directly)."""
        return self.weight.detach().to(dtype)  # a plain tensor, sharing the memory if dtype is its own


class ColumnParallelLinear(Linear):
    """Output features split over tp_size ranks: this rank holds rows `rows` of the full W [out_full, in].

    `rows` defaults to the rank's contiguous 1/tp_size share; a caller may pass another slice (e.g. a replicated
    KV head when there are fewer KV heads than ranks).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_size: int = 1, tp_rank: int = 0,
                 rows: slice | None = None):
        self.rows = rows if rows is not None else shard(out_features, tp_size, tp_rank)
        super().__init__(in_features, self.rows.stop - self.rows.start, bias)
        self.full_out_features = out_features

    def weight_specs(self, prefix: str) -> Iterator[WeightSpec]:
        yield WeightSpec(f"{prefix}.weight", (self.full_out_features, self.in_features), f"{prefix}.weight",
                         src=(self.rows,))
        if self.bias is not None:
            yield WeightSpec(f"{prefix}.bias", (self.full_out_features,), f"{prefix}.bias", src=(self.rows,))


class RowParallelLinear(Linear):
    """Input features split over the ranks of `group`: y = sum over ranks of x_r W_r^T, then + b (once)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_size: int = 1, tp_rank: int = 0,
                 group: dist.ProcessGroup | None = None):
        self.cols = shard(in_features, tp_size, tp_rank)
        super().__init__(in_features // tp_size, out_features, bias)
        self.full_in_features = in_features
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(self._matmul(x), self.group)
        return y + self.bias if self.bias is not None else y

    def weight_specs(self, prefix: str) -> Iterator[WeightSpec]:
        yield WeightSpec(f"{prefix}.weight", (self.out_features, self.full_in_features), f"{prefix}.weight",
                         src=(slice(None), self.cols))
        if self.bias is not None:
            yield WeightSpec(f"{prefix}.bias", (self.out_features,), f"{prefix}.bias")


class Embedding(nn.Module):
    """Token embedding [V, H], replicated."""

    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
