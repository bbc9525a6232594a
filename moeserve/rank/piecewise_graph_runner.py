"""PiecewiseGraphRunner: prefill (extend) and mixed steps replayed from CUDA graphs cut at attention.

An extend step's attention depends on every request's lengths (the padded groups of extend_plan.py, the prefix
read back from the cache), so no graph of fixed shapes holds it; everything else in a layer (projections, norms,
rotary and the cache write, the MoE with its routing, dispatch and combine) depends on the token count T alone.
So, as SGLang's and vLLM's piecewise CUDA graphs do, the forward is captured in pieces, one per stretch between two
attentions, for each of a few token counts (`token_buckets`), and a step's tokens are padded to the next one:

    replay piece 0 (embedding .. layer 0's attention inputs) -> attention 0, eager -> replay piece 1 (layer 0's
    output projection .. layer 1's attention inputs) -> ... -> replay the last piece (.. the last layer's output)
    -> the final norm and LM head on the rows that need logits, eager (their count varies)

The capture runs the model once per bucket with `AttentionMetadata.pieces` set: `attend_parts` hands each
attention call to `_Capture.split`, which copies the attention's inputs into static buffers, ends the piece, runs
the attention (so the capture's later pieces see real shapes), and begins the next piece reading the attention's
output from another static buffer. The buffers are shared by all layers and buckets (pieces replay one after
another on one stream), so they cost one layer's attention rows at the largest bucket. At replay the attention
calls run on the step's own metadata, built without rotary (`AttentionMetadata.build(batch, None)`). Padding
tokens embed token 0 at position 0 and write their cache rows to the scratch slot 0, which no request owns; they
go through the MoE like any token (a few padded rows of work) and never reach attention or the logits.

With several DP groups (--enable-static-shape-extend) the runner replays only at the token count all ranks agreed
on in the step header (rank/static_extend.py), an idle group's step too (padding rows only), and its graphs are
captured with the header [n] * groups; a step without that agreement runs eagerly. Written, not run on GPUs.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moeserve.core.forward_batch import ForwardBatch, ForwardMode
from moeserve.layers.attention.ops import AttentionMetadata, attend_parts
from moeserve.rank.cuda_graph_runner import capture_each, try_capture
from moeserve.rank.static_extend import forward_padded, static_extend_ready

logger = logging.getLogger(__name__)


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts captured up to max_tokens: powers of two and their midpoints (at most a third is padding)."""
    out, n = [], 8
    while n < max_tokens:
        out.append(n)
        if n >= 64 and n + n // 2 < max_tokens:
            out.append(n + n // 2)
        n *= 2
    return sorted({*out, max_tokens})


@dataclass
class _Boundary:
    """One attention call between two pieces: what runs, where its inputs and its output lie."""

    attend: Callable[..., torch.Tensor]
    inputs: list[torch.Tensor]  # static buffers [max_tokens, ...] the piece before writes
    output: torch.Tensor  # static buffer [max_tokens, ...] the piece after reads


@dataclass
class _Bucket:
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    boundaries: list[_Boundary] = field(default_factory=list)


class PiecewiseGraphRunner:
    """Captures and replays one rank's extend and mixed forwards in pieces (see the module doc)."""

    def __init__(self, model, kv_pool, max_tokens: int, device: torch.device, pool=None, groups: int = 1):
        self.model = model
        self.groups = groups  # DP groups whose agreed token count it replays at (1: one group only)
        self.num_steps = 0  # steps run at an agreed count (several groups), replayed or padded eagerly
        self.kv_pool = kv_pool
        self.device = device
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(self.max_tokens, **i64)
        self.positions = torch.zeros(self.max_tokens, **i64)
        self.out_cache_loc = torch.zeros(self.max_tokens, **i64)
        self.hidden: torch.Tensor | None = None  # [max_tokens, H]: the last piece's output (first capture)
        self._buffers: dict[tuple, torch.Tensor] = {}  # (role, index, row shape, dtype) -> static buffer
        self.captured: dict[int, _Bucket | None] = {}
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)
        self.replays = 0  # steps that ran from the graphs, and the padding tokens they computed
        self.padded_tokens = 0

    def ready(self, batch: ForwardBatch | None) -> bool:
        """This rank can run its part of a static-shape extend step (rank/static_extend.py)."""
        return static_extend_ready(batch, self.max_tokens)

    def can_run(self, batch: ForwardBatch) -> bool:
        if self.groups > 1:  # several DP groups: only at the count all ranks agreed on (an idle group too)
            return batch.static_num_tokens is not None and self.ready(batch)
        one_group = batch.global_num_tokens is None or len(batch.global_num_tokens) == 1
        return one_group and batch.mode.is_extend and 0 < batch.num_tokens <= self.max_tokens

    def bucket(self, num_tokens: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_tokens)]

    # ------------------------------------------------------------------ capture
    @torch.inference_mode()
    def capture_all(self, progress: bool = True) -> None:
        """Every bucket now, the largest first (its pool blocks then serve the smaller ones)."""
        what = "piecewise CUDA graphs"
        seconds, gib = capture_each(list(reversed(self.buckets)), self.captured, self._capture, what, progress,
                                    self.device)
        done = [b for b in self.captured.values() if b is not None]
        logger.info("captured piecewise CUDA graphs for extend steps of %s tokens (%d pieces each) in %.1f s, "
                    "%.2f GiB", self.buckets, len(done[0].graphs) if done else 0, seconds, gib)

    @torch.inference_mode(False)  # plain tensors, like the scheduler's batches
    def _static_batch(self, n: int) -> ForwardBatch:
        """One request of n new tokens, no prefix, every cache write to the scratch slot 0."""
        i64 = dict(dtype=torch.int64, device=self.device)
        return ForwardBatch(
            mode=ForwardMode.EXTEND, input_ids=self.input_ids[:n], positions=self.positions[:n],
            seq_lens=torch.tensor([n], **i64), extend_lens=torch.tensor([n], **i64),
            prefix_lens=torch.zeros(1, **i64), out_cache_loc=self.out_cache_loc[:n],
            kv_indices=self.out_cache_loc[:n], kv_indptr=torch.tensor([0, n], **i64),
            qo_indptr=torch.tensor([0, n], **i64), kv_pool=self.kv_pool, seq_lens_cpu=[n], extend_lens_cpu=[n],
            prefix_lens_cpu=[0], global_num_tokens=[n] * self.groups, any_extend=True,
        )

    def _capture(self, n: int) -> _Bucket:
        fb = self._static_batch(n)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            # warm up (lazy inits, kernel compiles, the allocator); the first pass also allocates the static
            # buffers, which must not come from the graphs' pool
            h = self.model.hidden_states(fb, pieces=_Capture(self, n, record=False))
            self.model.hidden_states(fb)
            if self.hidden is None:
                self.hidden = torch.zeros(self.max_tokens, h.shape[-1], dtype=h.dtype, device=self.device)
            del h
            cap = _Capture(self, n)
            try:
                cap.begin()
                self.hidden[:n].copy_(self.model.hidden_states(fb, pieces=cap))
                cap.end()
            finally:
                cap.abandon()  # a piece that failed midway ends its capture: the stream captures no more
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        logger.debug("captured %d graph pieces for %d tokens", len(cap.bucket.graphs), n)
        return cap.bucket

    def buffer(self, role: str, index: int, like: torch.Tensor) -> torch.Tensor:
        """The static buffer [max_tokens, *like.shape[1:]] for this role and position (shared by all layers and
        buckets: pieces replay one after another)."""
        key = (role, index, tuple(like.shape[1:]), like.dtype)
        if key not in self._buffers:
            self._buffers[key] = torch.zeros(self.max_tokens, *like.shape[1:], dtype=like.dtype, device=self.device)
        return self._buffers[key]

    # ------------------------------------------------------------------ replay
    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits of an extend or mixed batch whose tensors are already on the device (as model.forward)."""
        t = batch.num_tokens
        n = batch.static_num_tokens or self.bucket(t)
        self.num_steps += batch.static_num_tokens is not None
        if n not in self.captured:  # capture_all was not called (tests): capture now
            self.captured[n] = try_capture(self._capture, n, "piecewise CUDA graphs")
        bucket = self.captured[n]
        if bucket is None:  # several groups: the collectives still need the agreed count
            return forward_padded(self.model, batch, n, self.groups) if self.groups > 1 else self.model(batch)
        self.input_ids[:t].copy_(batch.input_ids)
        self.positions[:t].copy_(batch.positions)
        self.out_cache_loc[:t].copy_(batch.out_cache_loc)
        if t < n:  # padding tokens: token 0 at position 0, written to the scratch slot
            self.input_ids[t:n].zero_()
            self.positions[t:n].zero_()
            self.out_cache_loc[t:n].zero_()
        self.replays += 1
        self.padded_tokens += n - t
        meta = AttentionMetadata.build(batch, None) if t else None  # an idle group: no attention to run
        for graph, b in zip(bucket.graphs, [*bucket.boundaries, None], strict=True):
            graph.replay()
            if b is not None and meta is not None:
                b.output[:t].copy_(attend_parts(meta, b.attend, *(x[:t] for x in b.inputs)))
        return self.model.compute_logits(self.hidden[:t], batch)


class _Capture:
    """The PieceSplitter of one bucket's capture: ends a piece at each attention call and begins the next.
    record=False: a warm-up pass that only allocates the static buffers (outside any capture)."""

    def __init__(self, runner: PiecewiseGraphRunner, n: int, record: bool = True):
        self.runner, self.n, self.record = runner, n, record
        self.bucket = _Bucket()
        self.graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self.runner.stream.synchronize()  # the eager attention before this piece is done
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.runner.pool)

    def end(self) -> None:
        self.graph.capture_end()
        self.bucket.graphs.append(self.graph)
        self.graph = None

    def abandon(self) -> None:
        """End a capture left open by an error (CUDA refuses every later sync until it ends); a no-op after end."""
        if self.graph is not None:
            with contextlib.suppress(RuntimeError):  # an invalidated capture ends with an error of its own
                self.graph.capture_end()
            self.graph = None

    def split(self, meta: AttentionMetadata, attend: Callable[..., torch.Tensor],
              rows: tuple[torch.Tensor, ...]) -> torch.Tensor:
        n, runner = self.n, self.runner
        inputs = [runner.buffer("in", i, r) for i, r in enumerate(rows)]
        if not self.record:
            out = attend_parts(dataclasses.replace(meta, pieces=None), attend, *rows)
            runner.buffer("out", 0, out)
            return out
        for buf, r in zip(inputs, rows, strict=True):
            buf[:n].copy_(r)
        self.end()
        out = attend_parts(dataclasses.replace(meta, pieces=None), attend, *(buf[:n] for buf in inputs))
        output = runner.buffer("out", 0, out)
        output[:n].copy_(out)
        self.bucket.boundaries.append(_Boundary(attend, inputs, output))
        self.begin()
        return output[:n]
