"""A checkpoint's weight format, from config.json's `quantization_config`: DeepSeek's block FP8 or none.

DeepSeek-V3/R1 publish
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]}
with a `<name>.weight_scale_inv` float32 tensor of one scale per 128 x 128 block beside each quantized weight. That
is the one format moeserve reads; any other method, format, activation scheme or block size is refused here, at
config time, with what was found.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FP8_BLOCK = (128, 128)


@dataclass(frozen=True)
class Fp8Config:
    """Block-scaled FP8 weights (e4m3, one float32 scale per 128 x 128 block), activations quantized on the fly per
    token in groups of 128."""

    weight_block_size: tuple[int, int] = FP8_BLOCK

    def describe(self) -> str:
        n, k = self.weight_block_size
        return f"fp8 e4m3, {n}x{k} weight blocks, dynamic per-token activations"


def parse_quantization_config(raw: dict[str, Any] | None) -> Fp8Config | None:
    """config.json's quantization_config -> Fp8Config, or None for an unquantized checkpoint. Raises ValueError."""
    if not raw:
        return None
    method = raw.get("quant_method")
    if method != "fp8":
        raise ValueError(f"config.json: quantization_config.quant_method {method!r} is not supported; moeserve reads "
                         "DeepSeek's block FP8 (quant_method fp8) or unquantized checkpoints")
    expected = {"fmt": "e4m3", "activation_scheme": "dynamic"}
    for key, value in expected.items():
        if raw.get(key, value) != value:
            raise ValueError(f"config.json: quantization_config.{key} {raw[key]!r} is not supported (only {value!r}, "
                             "DeepSeek's FP8 format)")
    block = raw.get("weight_block_size")
    if block is None or list(block) != list(FP8_BLOCK):
        raise ValueError(f"config.json: quantization_config.weight_block_size {block!r} is not supported: moeserve's "
                         f"FP8 kernels take blocks of {list(FP8_BLOCK)} (per-tensor or per-channel FP8 is not read)")
    return Fp8Config()
