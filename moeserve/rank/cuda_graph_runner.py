"""CudaGraphRunner: decode steps replayed from CUDA graphs, so the host issues one launch instead of thousands.

A decode step's shapes depend on two numbers only: the batch size B and the longest sequence L (the padded
[B, L] block of cache slots attention reads). Graphs are captured lazily, one per (batch bucket, length bucket),
into one shared memory pool, and replayed with the step's inputs copied into static buffers. Padding rows
decode token 0 at position 0 and write their KV to the scratch slot 0, which no request owns.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import torch

from moeserve.core.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)


def batch_buckets(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    out = [s for s in sizes if s < max_bs] + [max_bs]
    return sorted(set(out))


def length_buckets(max_len: int) -> list[int]:
    out, n = [], 128
    while n < max_len:
        out.append(n)
        n *= 2
    return [*out, max_len]


class CudaGraphRunner:
    """Captures and replays the model's decode forward for one rank."""

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], kv_pool, max_bs: int, max_len: int,
                 device: torch.device):
        self.forward = forward  # the model's forward (or its compiled form): what is captured
        self.kv_pool = kv_pool
        self.device = device
        self.bs_buckets = batch_buckets(max_bs)
        self.len_buckets = length_buckets(max_len)
        self.max_bs, self.max_len = self.bs_buckets[-1], self.len_buckets[-1]
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(self.max_bs, **i64)
        self.positions = torch.zeros(self.max_bs, **i64)
        self.seq_lens = torch.ones(self.max_bs, **i64)
        self.out_cache_loc = torch.zeros(self.max_bs, **i64)
        self.decode_slots = torch.zeros(self.max_bs, self.max_len, **i64)
        self.arange = torch.arange(self.max_bs + 1, **i64)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor] | None] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def can_run(self, batch: ForwardBatch) -> bool:
        # NOTE: with several DP groups, ranks would need to agree on one padded batch size (and an idle rank on
        # the dispatch rounds); until the header carries that, multi-group steps run eagerly.
        one_group = batch.global_num_tokens is None or len(batch.global_num_tokens) == 1
        return (one_group and batch.mode.is_decode and 0 < batch.batch_size <= self.max_bs and batch.decode_slots is not None
                and batch.decode_slots.shape[1] <= self.max_len and not batch.return_all_logits)

    @torch.inference_mode(False)  # plain tensors, like the scheduler's batches (what a compiled forward expects)
    def _static_batch(self, bs: int, length: int) -> ForwardBatch:
        ones = self.arange.new_ones(bs)
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            seq_lens=self.seq_lens[:bs], extend_lens=ones, prefix_lens=self.seq_lens[:bs] - 1,
            out_cache_loc=self.out_cache_loc[:bs], kv_indices=self.decode_slots[:bs, :length].reshape(-1),
            kv_indptr=self.arange[: bs + 1] * length, qo_indptr=self.arange[: bs + 1], kv_pool=self.kv_pool,
            seq_lens_cpu=[length] * bs, extend_lens_cpu=[1] * bs, prefix_lens_cpu=[length - 1] * bs,
            logits_indices=self.arange[:bs], decode_slots=self.decode_slots[:bs, :length],
            global_num_tokens=[bs],  # the dispatch rounds of a low-latency EP step follow the padded size
        )

    def _capture(self, bs: int, length: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        fb = self._static_batch(bs, length)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: lazy inits, autotuning, allocator
                self.forward(fb)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            logits = self.forward(fb)
        logger.info("captured a CUDA graph for decode batch %d, length %d", bs, length)
        return graph, logits

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, V] of a decode batch whose tensors are already on the device."""
        b = batch.batch_size
        length_needed = batch.decode_slots.shape[1]
        bs = self.bs_buckets[bisect.bisect_left(self.bs_buckets, b)]
        length = self.len_buckets[bisect.bisect_left(self.len_buckets, length_needed)]
        self.input_ids[:b].copy_(batch.input_ids)
        self.positions[:b].copy_(batch.positions)
        self.seq_lens[:b].copy_(batch.seq_lens)
        self.out_cache_loc[:b].copy_(batch.out_cache_loc)
        self.decode_slots[:b, :length_needed].copy_(batch.decode_slots)
        if b < bs:  # padding rows: token 0 at position 0, one cached token in the scratch slot
            self.input_ids[b:bs].zero_()
            self.positions[b:bs].zero_()
            self.seq_lens[b:bs].fill_(1)
            self.out_cache_loc[b:bs].zero_()
            self.decode_slots[b:bs].zero_()
        key = (bs, length)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(bs, length)
            except RuntimeError as e:  # some op cannot be captured: run this shape eagerly from now on
                logger.warning("CUDA graph capture failed for batch %d, length %d; running it eagerly: %s",
                               bs, length, e)
                self.graphs[key] = None
        entry = self.graphs[key]
        if entry is None:
            return self.forward(batch)
        graph, logits = entry
        graph.replay()
        return logits[:b]
