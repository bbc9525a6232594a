"""CompiledDecode: decode steps through torch.compile (`--enable-torch-compile`).

The model's forward is compiled once with the batch's sizes (requests, sequence length) as symbols, so one
compiled graph serves every decode batch up to `--torch-compile-max-bs`; a batch of one, which the compiler would
specialise, runs padded to two (the padding request only touches the scratch slot, like CUDA-graph padding).
Inductor fuses the many small element-wise operators of a decode step (norms, rotary, routing, the attention
softmax) into a few kernels, which is where a small-batch step spends much of its time on a CPU. GEMMs stay
library calls; the experts' kernels are opaque custom ops (kernels/grouped_gemm.py, kernels/cpu_experts.py).

The graph is compiled at start-up on a batch that only touches the KV pool's scratch slot, so no request waits
for the compiler. On CUDA the compiled forward is what the CUDA graph runner captures.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from moeserve.core.forward_batch import DECODE_LEN, ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)


class CompiledDecode:
    """The compiled decode forward of one model, for batches of 1 to max_bs requests."""

    def __init__(self, model: torch.nn.Module, max_bs: int, kv_pool, device: torch.device):
        self.model, self.max_bs, self.kv_pool, self.device = model, max_bs, kv_pool, device
        self.fn = torch.compile(model.forward)  # the batch's sizes are marked dynamic at each call

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.mode.is_decode and 0 < batch.batch_size <= self.max_bs and not batch.return_all_logits
                and batch.decode_slots is not None)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        if batch.batch_size == 1:  # the compiler specialises size 1: pad to 2 rather than compile a second graph
            return self.fn(_dynamic_sizes(_pad_one(batch)))[:1]
        return self.fn(_dynamic_sizes(batch))

    def capture_all(self, progress: bool = True) -> None:
        """Compile now, on a decode batch of two that reads and writes only the KV pool's scratch slot 0."""
        start = time.perf_counter()
        bs, length = 2, 3  # distinct sizes: equal ones would be assumed equal forever (duck sizing)
        batch = ForwardBatch.build(ForwardMode.DECODE, [0] * (bs * DECODE_LEN), [length] * bs, [DECODE_LEN] * bs,
                                   [0] * (bs * DECODE_LEN), [0] * (bs * length))
        batch.decode_slots = torch.zeros(bs, length, dtype=torch.int64)
        batch = batch.to(self.device)  # built like a scheduler's batch, outside inference mode: the same guards
        batch.kv_pool = self.kv_pool
        with torch.inference_mode():
            self.fn(_dynamic_sizes(batch))
        logger.info("torch.compile: decode forward compiled in %.1f s (batches up to %d)",
                    time.perf_counter() - start, self.max_bs)


@torch.inference_mode(False)  # a copied tensor must be a plain tensor too
def _dynamic_sizes(batch: ForwardBatch) -> ForwardBatch:
    """Mark the batch's sizes (requests, sequence length) as symbols for the compiler. Only these: with every size
    dynamic, a model size that happens to equal the warm-up batch size (2 KV heads, say) would be merged with it.
    One layout, one graph: a tensor that is a strided view (a CUDA-graph runner's slot block) or starts inside
    its storage (a packed host-to-device copy's views) is copied to a contiguous tensor of its own, since the
    compiler guards on strides and storage offsets too (they recompiled the forward on the GPU)."""
    fresh = {f: t.clone(memory_format=torch.contiguous_format) for f in _BATCH_TENSORS
             if (t := getattr(batch, f)) is not None and (t.storage_offset() or not t.is_contiguous())}
    if fresh:
        batch = dataclasses.replace(batch, **fresh)
    for f in _BATCH_TENSORS:
        t = getattr(batch, f)
        if t is not None:
            for d in range(t.dim()):
                torch._dynamo.maybe_mark_dynamic(t, d)
    return batch


_BATCH_TENSORS = ("input_ids", "positions", "seq_lens", "extend_lens", "prefix_lens", "out_cache_loc", "kv_indices",
                  "kv_indptr", "qo_indptr", "logits_indices", "decode_slots")


@torch.inference_mode(False)  # plain tensors, like the scheduler's: inference tensors would fail a guard
def _pad_one(batch: ForwardBatch) -> ForwardBatch:
    """A batch of one plus a padding request: DECODE_LEN tokens 0 at position 0, cached in the scratch slot 0."""
    L = DECODE_LEN

    def cat(t: torch.Tensor, pad: int | torch.Tensor, n: int = 1) -> torch.Tensor:  # device ops only (graphs)
        return torch.cat((t, pad if isinstance(pad, torch.Tensor) else t.new_full((n,), pad)))

    return dataclasses.replace(
        batch, input_ids=cat(batch.input_ids, 0, L), positions=cat(batch.positions, 0, L),
        seq_lens=cat(batch.seq_lens, L), extend_lens=cat(batch.extend_lens, L), prefix_lens=cat(batch.prefix_lens, 0),
        out_cache_loc=cat(batch.out_cache_loc, 0, L), kv_indices=cat(batch.kv_indices, 0, L),
        kv_indptr=cat(batch.kv_indptr, batch.kv_indptr[-1:] + L), qo_indptr=cat(batch.qo_indptr, 2 * L),
        seq_lens_cpu=[*batch.seq_lens_cpu, L], extend_lens_cpu=[*batch.extend_lens_cpu, L],
        prefix_lens_cpu=[*batch.prefix_lens_cpu, 0],
        logits_indices=None if batch.logits_indices is None else cat(batch.logits_indices, 2 * L - 1),
        decode_slots=torch.cat((batch.decode_slots, batch.decode_slots.new_zeros(1, batch.decode_slots.shape[1]))),
    )
