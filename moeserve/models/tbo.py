"""Two-batch overlap (TBO), part 2: the executor (part 1, the split and the decision: core/tbo_split.py).

Each micro-batch runs the model's layers as one program (`DecoderLayer.stages`, a generator) that yields while a
collective of its own is in flight. The executor steps the two programs round-robin, A then B, one stage each,
on one thread (SGLang's `execute_overlapped_operations` with its prefill order: yields after dispatch_a and after
combine_a). For MoE layer L the order is

    A: attn(L) gate dispatch_a            | A's dispatch in flight ...
    B: attn(L) gate dispatch_a            | ... behind B's attention and gate;    B's dispatch in flight ...
    A: dispatch_b experts combine_a       | ... behind A's experts;                 A's combine in flight ...
    B: dispatch_b experts combine_a       | ... behind B's experts;                 B's combine in flight ...
    A: shared combine_b, attn(L+1) gate dispatch_a  | ... behind A's shared experts and next attention
    B: shared combine_b, attn(L+1) gate dispatch_a
    ...

Dense layers (first_k_dense) have no yield: a micro-batch runs them straight through. The schedule depends only on
the layer list, so every rank issues the same collectives in the same order (attention-TP all-reduces included).
Within a layer A's attention runs before B's, so a prompt cut in two (B holds its second part) finds the KV rows
of its first part written when B's attention reads them.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from moeserve.core.forward_batch import ForwardBatch
from moeserve.core.tbo_split import merge_rows, split_batch
from moeserve.layers.attention.ops import AttentionMetadata


@dataclass
class MicroBatchState:
    """One micro-batch as it moves through the layers: its batch, attention metadata and hidden states."""

    batch: ForwardBatch
    meta: AttentionMetadata
    h: torch.Tensor  # the last layer's output is h + residual (DecoderLayer.forward)
    residual: torch.Tensor | None = None


def execute_overlapped(programs: list[Generator[None, None, None]]) -> None:
    """Step the programs round-robin, one stage (up to the next yield) each, until all are done."""
    active = list(programs)
    while active:
        for p in list(active):
            try:
                next(p)
            except StopIteration:
                active.remove(p)


def _program(layers: Iterable[Any], mb: MicroBatchState, index: int) -> Generator[None, None, None]:
    for layer in layers:
        yield from layer.stages(mb, index)


def run_two_batch_overlap(layers: Iterable[Any], batch: ForwardBatch, h: torch.Tensor,
                          rope: torch.Tensor) -> torch.Tensor:
    """All decoder layers over `batch` as two overlapped micro-batches; the hidden states [T, H] in batch order.

    h, rope: the embedded tokens and rotary angles of the whole batch (per token, so they are sliced)."""
    a, b = split_batch(batch)
    s = a.num_tokens
    states = []
    for part, rows in ((a, slice(0, s)), (b, slice(s, batch.num_tokens))):
        states.append(MicroBatchState(part, AttentionMetadata.build(part, rope[rows]), h[rows]))
    layers = list(layers)
    execute_overlapped([_program(layers, st, i) for i, st in enumerate(states)])
    return merge_rows(batch, *(st.h + st.residual for st in states))
