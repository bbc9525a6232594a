"""FP8 weights at load time (the loader's part of DeepSeek's block-FP8 format; the layers are in
layers/quantization/):

- an FP8 checkpoint: every quantized weight must be e4m3 and its `weight_scale_inv` float32, finite and positive;
  what is wrong fails before (dtypes) or while (values) loading, naming the tensor;
- an unquantized checkpoint with --quantization fp8, and --load-format dummy of an FP8 model: each weight of an FP8
  layer arrives in full precision and is quantized with the recipe (kernels/fp8_quant.py) on the device, once per
  tensor, before this rank's part of it (and of its scales) is taken.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moeserve.kernels.fp8_quant import FP8_DTYPE, quantize_weight
from moeserve.layers.quantization.fp8_linear import SCALE_SUFFIX
from moeserve.layers.weights import WeightSpec

SAFETENSORS_FP8 = "F8_E4M3"
SAFETENSORS_F32 = "F32"


def is_scale_key(key: str) -> bool:
    return key.endswith(SCALE_SUFFIX)


def quantized_keys(specs: list[WeightSpec], params: dict[str, torch.Tensor]) -> set[str]:
    """Checkpoint keys that FP8 layers take in e4m3, and their scales' keys."""
    keys = {s.key for s in specs if is_scale_key(s.key)}
    return keys | {s.key for s in specs if s.param is not None and params[s.param].dtype == FP8_DTYPE}


def check_fp8_dtypes(specs: list[WeightSpec], dtypes: dict[str, str], quantized: set[str], where: str) -> None:
    """An FP8 checkpoint: its quantized weights e4m3 and their scales float32 (the headers' dtypes); ValueError
    listing every tensor that is not."""
    problems = []
    for key in sorted({s.key for s in specs} & quantized):
        want = SAFETENSORS_F32 if is_scale_key(key) else SAFETENSORS_FP8
        if key in dtypes and dtypes[key] != want:
            problems.append(f"tensor {key!r} is {dtypes[key]} in the checkpoint, expected {want}")
    if problems:
        raise ValueError(f"FP8 checkpoint {where}: {len(problems)} tensor(s) of the wrong dtype (quantized weights "
                         "are F8_E4M3, their weight_scale_inv F32, as DeepSeek publishes them):\n  "
                         + "\n  ".join(problems[:20]))


def check_scale_values(key: str, scale: torch.Tensor) -> None:
    """A weight_scale_inv read from a checkpoint: every block's scale finite and > 0."""
    bad = ~torch.isfinite(scale) | (scale <= 0)
    if bool(bad.any()):
        raise ValueError(f"tensor {key!r}: {int(bad.sum())} of {scale.numel()} block scales are not finite and "
                         "positive; the checkpoint's FP8 scales are damaged")


def scale_specs_absent(specs: list[WeightSpec]) -> list[WeightSpec]:
    """The specs an unquantized checkpoint must satisfy: without the scales (quantizing at load makes them)."""
    return [s for s in specs if not is_scale_key(s.key)]


def weight_key(key: str) -> str:
    """`X.weight_scale_inv` -> `X.weight` (a weight's key is itself)."""
    return key.removesuffix(SCALE_SUFFIX)


class QuantizingReader:
    """Full e4m3 weights and their scales, from full-precision tensors read by `read_full(weight key)`; a tensor is
    quantized once and kept until another is asked for (a layer's specs name a weight and its scales together)."""

    def __init__(self, read_full: Callable[[str], torch.Tensor]):
        self._read = read_full
        self._key: str | None = None
        self._pair: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(self, key: str) -> torch.Tensor:
        """The whole e4m3 tensor of `X.weight`, or the whole float32 scales of `X.weight_scale_inv`."""
        base = weight_key(key)
        if base != self._key:
            self._key, self._pair = base, quantize_weight(self._read(base))
        return self._pair[1] if is_scale_key(key) else self._pair[0]
