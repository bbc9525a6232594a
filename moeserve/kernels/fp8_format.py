"""The numbers of DeepSeek-V3's FP8 format, shared by the recipe (fp8_quant.py) and the Triton kernels."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BLOCK = 128  # DeepSeek's weight_block_size [128, 128], and the activations' group size
WEIGHT_SCALE_FLOOR = 1e-12  # the scale of an all-zero block: 0 stays 0, nothing divides by 0
ACT_SCALE_FLOOR = 1e-12


def num_blocks(size: int) -> int:
    """Blocks of 128 covering a dimension of `size` (the last one partial)."""
    return -(-size // BLOCK)
