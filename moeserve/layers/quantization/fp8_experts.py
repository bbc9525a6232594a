"""The FP8 twin of the routed experts (layers/moe/experts.py): w13 [E_local, 2I', H] and w2 [E_local, H, I'] in
e4m3, each expert's matrices with one float32 scale per 128 x 128 block, from DeepSeek's per-expert
`experts.{e}.{gate,up,down}_proj.weight` and `.weight_scale_inv`. Gate and up are padded to I' = whole blocks as in
fp8_mlp.py (exact; I' = I for DeepSeek-V3).

    expert_e(x) = W2_e · (silu(W1_e x) * (W3_e x)),  x quantized per token in groups of 128 before each GEMM

The GEMMs are the block-scaled FP8 grouped GEMMs (kernels/fp8_grouped_gemm.py) in both layouts, each from the
activations (`fp8_grouped_gemm_act`: the quantizer, then the GEMM): the contiguous layout's rows quantized straight
from the tokens, SiLU-and-mul and the quantization between the GEMMs in one kernel. (Two fused forms measured slower
on an H200 and were dropped: a gate/up GEMM with SiLU-and-mul and the quantization in its epilogue, 3-4% at prefill
sizes and 21-26% at decode sizes, docs/BENCHMARKS.md; GEMM tiles that quantized their own rows, 0.51-0.87x as fast
as the quantizer then the GEMM at 64-256 decode tokens in CUDA graphs; and weight-only experts at decode, e4m3
weights widened to bf16 in the bf16 grouped GEMM with no quantizer at all, 0.35-0.71x as fast as this chain at
64-1,024 tokens in CUDA graphs, 2026-12-04.) A MaskedLayout whose x arrives already in
FP8 with its scales (the low-latency dispatcher's FP8 dispatch) goes straight in. On the CPU the experts keep their
weights dequantized as well and run the same math through torch's grouped GEMM (see fp8_linear.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from moeserve.core.layouts import ContiguousLayout, MaskedLayout
from moeserve.ep.stats import record_local_tokens
from moeserve.kernels.activation import silu_and_mul
from moeserve.kernels.fp8_grouped_gemm import (
    fp8_grouped_gemm_act,
    fp8_grouped_gemm_masked,
    fp8_grouped_gemm_masked_act,
)
from moeserve.kernels.fp8_quant import (
    BLOCK,
    dequantize_activations,
    dequantize_weight,
    fake_quantize_activations,
    num_blocks,
)
from moeserve.kernels.grouped_gemm import grouped_gemm
from moeserve.layers.moe.experts import Experts
from moeserve.layers.quantization.fp8_linear import SCALE_SUFFIX
from moeserve.layers.quantization.fp8_mlp import check_tp_blocks, fp8_param, scale_param
from moeserve.layers.weights import WeightSpec, block_slice


class Fp8Experts(Experts):
    """This rank's experts in block FP8; computes in `activation_dtype` (the model's dtype) around the GEMMs."""

    fp32_params = ("w13_scale_inv", "w2_scale_inv")
    takes_fp8 = True
    slot_params = ("w13", "w13_scale_inv", "w2", "w2_scale_inv")

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, expert_ids: Sequence[int],
                 checkpoint_names: tuple[str, str, str], runner_backend: str, activation_dtype: torch.dtype,
                 tp_size: int = 1, tp_rank: int = 0):
        super().__init__(hidden_size, intermediate_size, num_experts, expert_ids, checkpoint_names, runner_backend,
                         tp_size, tp_rank)
        E, H, inter = self.num_local_experts, hidden_size, self.intermediate_size
        check_tp_blocks("the routed experts", self)
        self.padded_intermediate = ip = num_blocks(inter) * BLOCK
        self.w13 = fp8_param(E, 2 * ip, H)
        self.w13_scale_inv = scale_param(E, 2 * ip // BLOCK, num_blocks(H))
        self.w2 = fp8_param(E, H, ip)
        self.w2_scale_inv = scale_param(E, num_blocks(H), ip // BLOCK)
        self.padding_numel = {"w13": E * 2 * (ip - inter) * H, "w2": E * H * (ip - inter)}
        self._activation_dtype = activation_dtype
        self._dense: tuple[torch.Tensor, torch.Tensor] | None = None  # CPU: (w13, w2) dequantized

    @property
    def activation_dtype(self) -> torch.dtype:
        return self._activation_dtype

    def forward(self, layout: ContiguousLayout | MaskedLayout) -> torch.Tensor:
        """Expert outputs in the layout's shape and in activation_dtype: [M, H] or [E_local, cap, H]."""
        if self._dense is not None:
            return self._forward_dequantized(layout)
        dt = self._activation_dtype
        if isinstance(layout, MaskedLayout):
            mm = layout.masked_m
            record_local_tokens(mm)
            if layout.x_scale is not None:
                h = fp8_grouped_gemm_masked(layout.x, layout.x_scale, self.w13, self.w13_scale_inv, mm, dt)
            else:
                h = fp8_grouped_gemm_masked_act(layout.x, self.w13, self.w13_scale_inv, mm, dt)
            return fp8_grouped_gemm_masked_act(h, self.w2, self.w2_scale_inv, mm, dt, silu=True)
        offs, counts = layout.expert_offsets, layout.num_tokens_per_expert
        record_local_tokens(counts)
        h = fp8_grouped_gemm_act(layout.x, self.w13, self.w13_scale_inv, offs, counts, dt, layout.pairs, layout.top_k)
        return fp8_grouped_gemm_act(h, self.w2, self.w2_scale_inv, offs, counts, dt, silu=True)

    def _forward_dequantized(self, layout: ContiguousLayout | MaskedLayout) -> torch.Tensor:
        """The CPU path: activations rounded through FP8, dequantized weights."""
        w13, w2 = self._dense
        if isinstance(layout, MaskedLayout):
            record_local_tokens(layout.masked_m)
            x = (dequantize_activations(layout.x, layout.x_scale, w13.dtype) if layout.x_scale is not None
                 else fake_quantize_activations(layout.x))
            h = silu_and_mul(torch.bmm(x, w13.transpose(1, 2)))
            return torch.bmm(fake_quantize_activations(h), w2.transpose(1, 2))
        offs, counts = layout.expert_offsets, layout.num_tokens_per_expert
        record_local_tokens(counts)
        h = silu_and_mul(grouped_gemm(fake_quantize_activations(layout.rows()), w13, offs, counts))
        return grouped_gemm(fake_quantize_activations(h), w2, offs, counts)

    def process_weights_after_loading(self, device: torch.device) -> None:
        """FP8 experts run the FP8 grouped GEMMs (the C++ CPU kernel takes fp32 / bf16 only); on the CPU, on
        dequantized copies."""
        if self.runner_backend == "cpu_kernel":
            raise ValueError("--moe-runner-backend cpu_kernel takes float32 or bfloat16 experts; these are FP8 "
                             "(choose auto or grouped_gemm)")
        self.use_cpu_kernel = False
        self._dense = None
        if torch.device(device).type == "cpu":
            self._cpu_layout()

    def _cpu_layout(self) -> None:
        """The CPU's dequantized copies (after loading, and again after add_slots: they cover the new slots)."""
        self._dense = (dequantize_weight(self.w13, self.w13_scale_inv, self._activation_dtype),
                       dequantize_weight(self.w2, self.w2_scale_inv, self._activation_dtype))

    def slots_changed(self) -> None:
        """After an EPLB swap: the CPU's dequantized copies again (the swap moved the e4m3 weights and scales)."""
        if self._dense is not None:
            self._cpu_layout()

    def expert_slot(self, read: Callable[[str], torch.Tensor], keys: tuple[str, str, str]) -> tuple[torch.Tensor, ...]:
        """One expert's (w13 [2I', H], w13_scale_inv, w2 [H, I'], w2_scale_inv), laid out as weight_specs loads a
        slot, from `read` of the e4m3 weights and their `weight_scale_inv` (an unquantized checkpoint's reader
        quantizes: fp8_loading.QuantizingReader)."""
        inter, ip, ib = self.intermediate_size, self.padded_intermediate, num_blocks(self.intermediate_size)
        (gate, s_gate), (up, s_up), (down, s_down) = ((read(k), read(k + SCALE_SUFFIX)) for k in keys)
        w13 = gate.new_zeros(self.w13.shape[1:])
        s13 = s_gate.new_zeros(self.w13_scale_inv.shape[1:])
        for start, w, scale in ((0, gate, s_gate), (ip, up, s_up)):
            w13[start:start + inter].copy_(w)
            s13[start // BLOCK:start // BLOCK + ib].copy_(scale)
        w2 = down.new_zeros(self.w2.shape[1:])
        w2[:, :inter].copy_(down)
        return w13, s13, w2, s_down

    def weight_specs(self, prefix: str) -> Iterator[WeightSpec]:
        """Every expert's three weights and their scales; those of experts this rank does not hold are expected but
        skipped."""
        inter, H, ip = self.intermediate_size, self.hidden_size, self.padded_intermediate
        full, rows = self.full_intermediate_size, self.rows  # a tensor-parallel MoE reads rows (whole blocks) of I
        ib, hb, block_rows = num_blocks(full), num_blocks(H), block_slice(rows, full, BLOCK)
        shapes = ((full, H), (full, H), (H, full))
        scale_shapes = ((ib, hb), (ib, hb), (hb, ib))
        ib = num_blocks(inter)
        held = set(self.expert_ids)
        for logical in range(self.num_experts):
            keys = self.expert_keys(prefix, logical)
            scale_keys = tuple(k + SCALE_SUFFIX for k in keys)
            if logical not in held:
                yield from (WeightSpec(k, s, None) for k, s in zip(keys + scale_keys, shapes + scale_shapes, strict=True))
                continue
            for slot in (i for i, e in enumerate(self.expert_ids) if e == logical):  # replicas: every slot
                for j, start in enumerate((0, ip)):  # gate, up
                    yield WeightSpec(keys[j], shapes[j], f"{prefix}.w13", src=(rows,),
                                     dst=(slot, slice(start, start + inter)))
                    yield WeightSpec(scale_keys[j], scale_shapes[j], f"{prefix}.w13_scale_inv", src=(block_rows,),
                                     dst=(slot, slice(start // BLOCK, start // BLOCK + ib)))
                yield WeightSpec(keys[2], shapes[2], f"{prefix}.w2", src=(slice(None), rows),
                                 dst=(slot, slice(None), slice(0, inter)))
                yield WeightSpec(scale_keys[2], scale_shapes[2], f"{prefix}.w2_scale_inv",
                                 src=(slice(None), block_rows), dst=(slot,))
