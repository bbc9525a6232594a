"""CudaGraphRunner: decode steps replayed from CUDA graphs, so the host issues one launch instead of thousands.

A decode step's shapes depend on two numbers only: the batch size B and the longest sequence L (the padded
[B, L] block of cache slots attention reads). `capture_all` captures one graph per (batch bucket, length bucket) at
start-up (a progress bar, then the count, time and memory in the log), into one shared memory pool; each writes
its logits into one shared output buffer, so the graphs' own intermediates can reuse the pool (with_hidden: the
forward returns (logits, hidden states [T, H]) and both land in shared buffers: speculative decoding's verify and
draft steps, whose next forward reads the hidden states). A step replays its bucket's graph with the inputs copied
into static buffers. Padding rows decode token 0 at position 0 and write
their KV to the scratch slot 0, which no request owns. A shape whose capture failed runs eagerly.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from moeserve.core.forward_batch import DECODE_LEN, ForwardBatch, ForwardMode
from moeserve.rank.static_shape import pad_decode, static_ready

logger = logging.getLogger(__name__)
K, V = TypeVar("K"), TypeVar("V")


def batch_buckets(max_bs: int, sizes: list[int] | None = None) -> list[int]:
    """The decode batch sizes captured: `sizes` (--cuda-graph-bs) up to max_bs, or moeserve's buckets."""
    if sizes:
        return [s for s in sizes if s <= max_bs] or [max_bs]
    sizes = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    out = [s for s in sizes if s < max_bs] + [max_bs]
    return sorted(set(out))


def length_buckets(max_len: int) -> list[int]:
    out, n = [], 128
    while n < max_len:
        out.append(n)
        n *= 2
    return [*out, max_len]


def try_capture(capture: Callable[[K], V], key: K, what: str) -> V | None:
    """capture(key), or None where some op cannot be captured: steps of that shape run eagerly from now on."""
    try:
        return capture(key)
    except RuntimeError as e:  # logged as text: a record holding `e` would hold its frames (the runner, the KV pool)
        logger.warning("%s: capture failed for %s; running it eagerly: %s", what, key, str(e))
        return None


def capture_each(keys: list[K], captured: dict[K, V | None], capture: Callable[[K], V], what: str, progress: bool,
                 device: torch.device) -> tuple[float, float]:
    """`try_capture` each key not yet in `captured`, under a progress bar; (seconds, GiB of device memory taken)."""
    from tqdm import tqdm

    free_before = torch.cuda.mem_get_info(device)[0]
    start = time.perf_counter()
    for key in tqdm(keys, desc=f"Capturing {what}", disable=not progress, mininterval=1.0):
        if key not in captured:
            captured[key] = try_capture(capture, key, what)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # the eager warm-ups' cached blocks: what stays is the graphs' pool
    return time.perf_counter() - start, (free_before - torch.cuda.mem_get_info(device)[0]) / 2**30


class CudaGraphRunner:
    """Captures and replays the model's decode forward for one rank."""

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor | tuple[torch.Tensor, torch.Tensor]], kv_pool,
                 max_bs: int, max_len: int, device: torch.device, sizes: list[int] | None = None, groups: int = 1,
                 with_hidden: bool = False):
        self.forward = forward  # the model's forward (or its compiled form): what is captured
        self.with_hidden = with_hidden  # forward returns (logits, hidden [T, H]): run_hidden gives both
        self.kv_pool = kv_pool
        self.device = device
        self.groups = groups  # DP groups: a step's header is [padded size] * groups (rank/static_shape.py)
        self.num_steps = 0  # steps run (replayed or, where a capture failed, padded eagerly)
        self.bs_buckets = batch_buckets(max_bs, sizes)
        self.len_buckets = length_buckets(max_len)
        self.max_bs, self.max_len = self.bs_buckets[-1], self.len_buckets[-1]
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(self.max_bs * DECODE_LEN, **i64)
        self.positions = torch.zeros(self.max_bs * DECODE_LEN, **i64)
        self.seq_lens = torch.full((self.max_bs,), DECODE_LEN, **i64)
        self.out_cache_loc = torch.zeros(self.max_bs * DECODE_LEN, **i64)
        self.decode_slots = torch.zeros(self.max_bs, self.max_len, **i64)
        self.arange = torch.arange(self.max_bs + 1, **i64)
        self.qo_indptr = self.arange * DECODE_LEN  # static like every buffer a graph reads
        self.last_rows = self.qo_indptr[1:] - 1  # each request's last token: its logits row
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor] | None] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.logits_out: torch.Tensor | None = None  # [max_bs, V] float32, written by every graph (first capture)
        self.hidden_out: torch.Tensor | None = None  # [max_bs, H] with_hidden, likewise

    @torch.inference_mode()  # as `run` captures and replays
    def capture_all(self, progress: bool = True) -> None:
        """Capture every (batch bucket, length bucket) now, largest batch first (its pool blocks then serve the
        smaller ones), so no request pays a capture."""
        keys = [(bs, n) for bs in reversed(self.bs_buckets) for n in reversed(self.len_buckets)]
        seconds, gib = capture_each(keys, self.graphs, self._capture, "CUDA graphs", progress, self.device)
        logger.info("captured %d CUDA graphs (decode batch sizes %s x lengths %s) in %.1f s, %.2f GiB",
                    sum(g is not None for g in self.graphs.values()), self.bs_buckets, self.len_buckets, seconds, gib)

    def ready(self, batch: ForwardBatch | None) -> bool:
        """This rank can run its part of a static-shape decode step (rank/static_shape.py)."""
        return static_ready(batch, self.max_bs, self.max_len)

    def can_run(self, batch: ForwardBatch) -> bool:
        # several DP groups: only at the padded size all ranks agreed on (an idle group runs padding rows only)
        if self.groups > 1:
            return batch.static_bs is not None and self.ready(batch)
        return batch.mode.is_decode and self.ready(batch)

    @torch.inference_mode(False)  # plain tensors, like the scheduler's batches (what a compiled forward expects)
    def _static_batch(self, bs: int, length: int) -> ForwardBatch:
        n = bs * DECODE_LEN  # tokens
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:n], positions=self.positions[:n],
            seq_lens=self.seq_lens[:bs], extend_lens=self.arange.new_full((bs,), DECODE_LEN),
            prefix_lens=self.seq_lens[:bs] - DECODE_LEN, out_cache_loc=self.out_cache_loc[:n],
            kv_indices=self.decode_slots[:bs, :length].reshape(-1), kv_indptr=self.arange[: bs + 1] * length,
            qo_indptr=self.qo_indptr[: bs + 1], kv_pool=self.kv_pool, seq_lens_cpu=[length] * bs,
            extend_lens_cpu=[DECODE_LEN] * bs, prefix_lens_cpu=[length - DECODE_LEN] * bs,
            logits_indices=self.last_rows[:bs], decode_slots=self.decode_slots[:bs, :length],
            global_num_tokens=[n] * self.groups,  # the dispatch rounds of a low-latency EP step: the padded size
        )

    def _capture(self, key: tuple[int, int]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        bs, length = key
        fb = self._static_batch(bs, length)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: lazy inits, kernel compiles (a compiled forward's too), allocator
                out = self.forward(fb)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        logits, hidden = out if self.with_hidden else (out, None)
        if self.logits_out is None:
            self.logits_out = torch.empty(self.max_bs, logits.shape[-1], dtype=logits.dtype, device=self.device)
        if hidden is not None and self.hidden_out is None:
            self.hidden_out = torch.empty(self.max_bs, hidden.shape[-1], dtype=hidden.dtype, device=self.device)
        del out, logits, hidden
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            out = self.forward(fb)
            if self.with_hidden:
                self.logits_out[:bs].copy_(out[0])
                self.hidden_out[:bs].copy_(out[1])
            else:
                self.logits_out[:bs].copy_(out)
        logger.debug("captured a CUDA graph for decode batch %d, length %d", bs, length)
        return graph, self.logits_out[:bs]

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, V] (each request's last token) of a decode batch whose tensors are already on the device."""
        out = self._replay(batch)
        return out[0] if self.with_hidden else out

    @torch.inference_mode()
    def run_hidden(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, V], hidden [B, H]) of a decode batch, from graphs captured with_hidden."""
        assert self.with_hidden
        return self._replay(batch)

    def _replay(self, batch: ForwardBatch):
        self.num_steps += 1
        b = batch.batch_size
        n = b * DECODE_LEN  # tokens
        bs = batch.static_bs or self.bs_buckets[bisect.bisect_left(self.bs_buckets, b)]
        length_needed = batch.decode_slots.shape[1] if b else 1  # an idle group: padding rows only
        length = self.len_buckets[bisect.bisect_left(self.len_buckets, length_needed)]
        if b:
            self.input_ids[:n].copy_(batch.input_ids)
            self.positions[:n].copy_(batch.positions)
            self.seq_lens[:b].copy_(batch.seq_lens)
            self.out_cache_loc[:n].copy_(batch.out_cache_loc)
            self.decode_slots[:b, :length_needed].copy_(batch.decode_slots)
        if b < bs:  # padding requests: token 0 at position 0, DECODE_LEN cached tokens in the scratch slot
            self.input_ids[n:bs * DECODE_LEN].zero_()
            self.positions[n:bs * DECODE_LEN].zero_()
            self.seq_lens[b:bs].fill_(DECODE_LEN)
            self.out_cache_loc[n:bs * DECODE_LEN].zero_()
            self.decode_slots[b:bs].zero_()
        key = (bs, length)
        if key not in self.graphs:  # capture_all was not called (tests): capture now
            self.graphs[key] = try_capture(self._capture, key, "CUDA graphs")
        entry = self.graphs[key]
        if entry is None:
            return self.forward(pad_decode(batch, bs, self.groups) if self.groups > 1 else batch)
        graph, logits = entry
        graph.replay()
        return (logits[:b], self.hidden_out[:b]) if self.with_hidden else logits[:b]
