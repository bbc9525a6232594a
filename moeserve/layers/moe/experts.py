"""This rank's routed experts, fused: w13 [E_local, 2I, H] ([gate; up]) and w2 [E_local, H, I].

    expert_e(x) = W2_e · (silu(W1_e x) * (W3_e x))

Checkpoints store each expert separately (`experts.{e}.gate_proj/up_proj/down_proj`, Mixtral `w1/w3/w2`); the
loader fuses them, reading only the experts this rank holds. In a tensor-parallel MoE (--ep-size 1, --tp-size N)
a rank holds every expert's rows `rows` of the intermediate dimension (I / N of them): gate and up rows, down
columns; its output is a partial sum, which the MoE layer all-reduces.

The kernels (--moe-runner-backend) are chosen once the weights are in, on their device: on the CPU the
moeserve kernel of moeserve/kernels/cpu_experts.py where it builds, else torch's grouped GEMM; on CUDA the Triton
grouped GEMMs of moeserve/kernels/moe_gemm.py (SiLU-and-mul fused, tuned launch configurations). bf16 experts on
a CPU whose kernels run packed weights (the amx and avx512bf16 builds) hold w13 and w2 packed (cpu_experts.pack:
w13 [E, 2I/16, H/2, 16, 2], w2 [E, H/16, I/2, 16, 2]) and nothing else: the slot stays the first dimension, so
the online rebalancer moves packed slots as it moves plain ones, and `expert_slot` packs what it reads.
`logical_weights()` gives them in the logical shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from moeserve.core.layouts import ContiguousLayout, MaskedLayout
from moeserve.ep.stats import local_tally, record_local_tokens
from moeserve.kernels import cpu_experts
from moeserve.kernels.moe_gemm import moe_gemm, moe_gemm_masked, moe_gemm_masked_reference, moe_gemm_reference
from moeserve.kernels.triton_available import triton_importable
from moeserve.layers.weights import WeightSpec, shard

RUNNER_BACKENDS = ("auto", "grouped_gemm", "cpu_kernel", "triton")  # --moe-runner-backend: see the module doc


class Experts(nn.Module):
    """Experts held by this rank. Local slot i holds logical expert `expert_ids[i]` of the checkpoint."""

    takes_fp8 = False  # True: a MaskedLayout may bring x in FP8 with its scales (layers/quantization/fp8_experts.py)

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, expert_ids: Sequence[int],
                 checkpoint_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 runner_backend: str = "auto", tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        self.runner_backend = runner_backend
        self.use_cpu_kernel = False  # decided by process_weights_after_loading, as are the grouped GEMMs:
        self.packed = False  # w13 and w2 hold the packed layout (the module docstring), on the CPU
        self.gemm, self.gemm_masked = moe_gemm_reference, moe_gemm_masked_reference  # Triton's where they run
        self.hidden_size = hidden_size
        self.tp_size, self.tp_rank = tp_size, tp_rank  # tp_size > 1: a tensor-parallel MoE, `rows` of every expert
        self.full_intermediate_size = intermediate_size  # I, in the checkpoint
        self.rows = shard(intermediate_size, tp_size, tp_rank)  # this rank's part of I
        self.intermediate_size = intermediate_size // tp_size
        self.num_experts = num_experts  # logical experts in the checkpoint
        self.expert_ids = list(expert_ids)
        self.num_local_experts = len(self.expert_ids)
        self.checkpoint_names = checkpoint_names
        E, inter, H = self.num_local_experts, self.intermediate_size, hidden_size
        self.w13 = nn.Parameter(torch.empty(E, 2 * inter, H), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, H, inter), requires_grad=False)

    @property
    def cpu_packed(self) -> cpu_experts.Packed | None:
        """(w13, w2) where they are packed for the CPU kernels, else None."""
        return (self.w13.data, self.w2.data) if self.packed else None

    def logical_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) in the logical shapes, whatever the layout (a copy where packed)."""
        return cpu_experts.unpack(self.w13.data, self.w2.data) if self.packed else (self.w13.data, self.w2.data)

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype of the tokens going in and out (the dispatchers' buffers)."""
        return self.w13.dtype

    def forward(self, layout: ContiguousLayout | MaskedLayout) -> torch.Tensor:
        """Expert outputs in the layout's shape: [M, H] (contiguous) or [E_local, cap, H] (masked)."""
        if isinstance(layout, MaskedLayout):
            assert layout.x_scale is None, "an FP8 layout reached experts that are not FP8"
            if self.packed:  # each expert's block of cap rows as a segment of the packed kernel (the valid rows)
                E, cap, H = layout.x.shape
                counts = layout.masked_m.to(torch.int32)
                record_local_tokens(counts[:self.num_local_experts])
                offsets = torch.arange(E + 1, dtype=torch.int32) * cap
                out = cpu_experts.cpu_experts(layout.x.view(E * cap, H), self.w13, self.w2, offsets, counts,
                                              self.cpu_packed)
                return out.view(E, cap, H)
            # expert utilization, accumulated on the device (ep/stats.py): the routed slots' counts, added by the
            # first GEMM into the counter (`tally`)
            tally = local_tally(self.num_local_experts, layout.x.device)
            # Rows past masked_m[e] are unspecified and ignored by combine (the torch path computes them too).
            h = self.gemm_masked(layout.x, self.w13, layout.masked_m, silu=True, tally=tally)
            return self.gemm_masked(h, self.w2, layout.masked_m)
        offs, counts = layout.expert_offsets, layout.num_tokens_per_expert
        if self.use_cpu_kernel:
            record_local_tokens(counts[:self.num_local_experts])
            return cpu_experts.cpu_experts(layout.rows(), self.w13, self.w2, offs, counts, self.cpu_packed)
        # SiLU-and-mul fused in the Triton kernel, which also gathers the layout's rows from the tokens
        h = self.gemm(layout.x, self.w13, offs, counts, silu=True, pairs=layout.pairs, top_k=layout.top_k,
                      tally=local_tally(self.num_local_experts, layout.x.device))
        return self.gemm(h, self.w2, offs, counts)

    def process_weights_after_loading(self, device: torch.device) -> None:
        """Pick the kernels for the weights' device and dtype; on the CPU, store each expert's matrix transposed in
        memory ([E, H, 2I] and [E, I, H]; the parameters keep their logical shapes). Both CPU kernels multiply by
        w.transpose(1, 2), which is then contiguous: the moeserve kernel needs it, and with a few rows per expert
        MKL streams the weights about 1.5x faster in that layout."""
        on_cpu = torch.device(device).type == "cpu"
        kernel_runs = on_cpu and cpu_experts.available(self.w13.dtype)
        if self.runner_backend == "cpu_kernel" and not kernel_runs:
            built = not on_cpu or cpu_experts.load() is not None
            raise ValueError(
                f"--moe-runner-backend cpu_kernel runs on the CPU with float32 or bfloat16 weights and a C++ "
                f"compiler; here the experts are {self.w13.dtype} on {self.w13.device}"
                + ("" if built else " and the kernel did not build (see the log)"))
        self.use_cpu_kernel = kernel_runs and self.runner_backend != "grouped_gemm"
        on_cuda = torch.device(device).type == "cuda"
        if self.runner_backend == "triton" and not (on_cuda and triton_importable()):
            raise ValueError(f"--moe-runner-backend triton runs on CUDA with Triton installed; here the experts are "
                             f"on {device}" + ("" if triton_importable() else " and Triton does not import"))
        if on_cuda and self.runner_backend in ("auto", "triton") and triton_importable():
            self.gemm, self.gemm_masked = moe_gemm, moe_gemm_masked
        if on_cpu:
            self._cpu_layout()

    def _cpu_layout(self) -> None:
        """Each expert's matrices transposed in memory, or packed where the kernels run packed weights (which then
        replace them)."""
        if self.packed:  # laid out already
            return
        packed = cpu_experts.pack(self.w13.data, self.w2.data) if self.use_cpu_kernel else None
        if packed is not None:
            self.w13.data, self.w2.data = packed
            self.packed = True
            return
        for w in (self.w13, self.w2):
            w.data = w.data.transpose(1, 2).contiguous().transpose(1, 2)

    slot_params = ("w13", "w2")  # the per-slot parameters, in add_slots' dict

    def add_slots(self, slots: dict[str, torch.Tensor]) -> int:
        """Append slots after the routed ones (the fused shared experts, MoE._fuse_shared_experts): each of
        slot_params as [n, *its per-expert shape] (GatedMLP.expert_slots). Returns the first new slot.
        num_local_experts still counts the routed slots."""
        if set(slots) != set(self.slot_params):
            raise ValueError(f"--enable-shared-experts-fusion: the shared experts' weights ({', '.join(slots)}) are "
                             f"not in the routed experts' format ({', '.join(self.slot_params)})")
        first = self.w13.shape[0]
        inter, H = self.intermediate_size, self.hidden_size  # a packed slot's logical shape, without unpacking
        logical = {"w13": torch.Size((2 * inter, H)), "w2": torch.Size((H, inter))} if self.packed else {}
        for name in self.slot_params:
            shape = logical.get(name) or getattr(self, name).shape[1:]
            if slots[name].shape[1:] != shape:
                raise ValueError(f"--enable-shared-experts-fusion: a shared slot's {name} is "
                                 f"{tuple(slots[name].shape[1:])}, a routed expert's {tuple(shape)}")
        if self.packed:  # the new slots packed as the others are
            new = cpu_experts.pack(*(slots[name].to(self.w13.dtype) for name in self.slot_params))
            assert new is not None, "slots of packed experts that do not pack"
            for p, t in zip((self.w13, self.w2), new, strict=True):
                p.data = torch.cat((p.data, t))
            return first
        for name in self.slot_params:
            p = getattr(self, name)
            p.data = torch.cat((p.data, slots[name].to(p.dtype)))
        if self.w13.device.type == "cpu":
            self._cpu_layout()
        return first

    def slots_changed(self) -> None:
        """Slots were overwritten in place (an EPLB swap): nothing is derived from them here (packed slots are
        written packed: expert_slot)."""

    def expert_slot(self, read: Callable[[str], torch.Tensor], keys: tuple[str, str, str]) -> tuple[torch.Tensor, ...]:
        """One expert's slot_params ([2I, H], [H, I]; packed as the slots are, where they are) from `read(checkpoint
        key)` of its keys (expert_keys): what the EPLB weight source hands the rebalancer."""
        gate, up, down = (read(k) for k in keys)
        w13, w2 = torch.cat([gate, up]).to(self.w13.dtype), down.to(self.w2.dtype)
        if not self.packed:
            return w13, w2
        packed = cpu_experts.pack(w13[None], w2[None])
        assert packed is not None, "an expert of packed experts that does not pack"
        return packed[0][0], packed[1][0]

    def expert_keys(self, prefix: str, logical: int) -> tuple[str, str, str]:
        """Checkpoint keys of one expert's gate, up and down projections."""
        return tuple(f"{prefix}.{logical}.{n}.weight" for n in self.checkpoint_names)

    def weight_specs(self, prefix: str) -> Iterator[WeightSpec]:
        """Every expert's three tensors (this rank's rows of I); those of experts this rank does not hold are
        expected but skipped."""
        full, inter, H, rows = self.full_intermediate_size, self.intermediate_size, self.hidden_size, self.rows
        held = set(self.expert_ids)
        for logical in range(self.num_experts):
            keys = self.expert_keys(prefix, logical)
            if logical not in held:
                yield from (WeightSpec(k, s, None) for k, s in zip(keys, ((full, H), (full, H), (H, full)), strict=True))
                continue
            for slot in (i for i, e in enumerate(self.expert_ids) if e == logical):  # replicas: every slot
                yield WeightSpec(keys[0], (full, H), f"{prefix}.w13", src=(rows,), dst=(slot, slice(0, inter)))
                yield WeightSpec(keys[1], (full, H), f"{prefix}.w13", src=(rows,), dst=(slot, slice(inter, 2 * inter)))
                yield WeightSpec(keys[2], (H, full), f"{prefix}.w2", src=(slice(None), rows), dst=(slot,))
