"""Repetition, frequency and presence penalties: token-count tensors and the logit update they drive.

Semantics follow vLLM (and HF for the repetition penalty):
- repetition_penalty r over tokens seen in prompt + output: logit / r where logit > 0, logit * r otherwise;
- frequency_penalty f and presence_penalty p over output tokens only: logit - f * count - p * (count > 0).
The repetition penalty goes first. A row with r = 1, f = 0, p = 0 comes out bit-identical, so the batch
needs no per-row branching.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch


def _flat_token_index(sources: Sequence[Sequence[Sequence[int]]], vocab_size: int) -> torch.Tensor:
    """Host int64 tensor of `row * vocab_size + token_id` for every token of every row of every source.

    `sources` is a tuple of per-request id lists (e.g. prompts and outputs), each of length B.
    """
    batch_size = len(sources[0])
    lengths = np.array([sum(len(src[b]) for src in sources) for b in range(batch_size)], dtype=np.int64)
    # np.fromiter over one chained iterator: about 3x faster than torch.tensor(list) on long prompts.
    ids = np.fromiter(chain.from_iterable(src[b] for b in range(batch_size) for src in sources),
                      dtype=np.int64, count=int(lengths.sum()))
    rows = np.repeat(np.arange(batch_size, dtype=np.int64), lengths)
    return torch.from_numpy(rows * vocab_size + ids)


def build_token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int,
                       device: torch.device | str) -> torch.Tensor:
    """Occurrences of each token per request: [B, V] int32 on `device` (one host-to-device copy)."""
    batch_size = len(token_ids)
    index = _flat_token_index((token_ids,), vocab_size).to(device)
    counts = torch.zeros(batch_size * vocab_size, dtype=torch.int32, device=device)
    counts.scatter_add_(0, index, torch.ones_like(index, dtype=torch.int32))
    return counts.view(batch_size, vocab_size)


def build_token_mask(*sources: Sequence[Sequence[int]], vocab_size: int,
                     device: torch.device | str) -> torch.Tensor:
    """Whether each token occurs in any of `sources` (per-request id lists, e.g. prompts, outputs): [B, V] bool."""
    batch_size = len(sources[0])
    assert all(len(src) == batch_size for src in sources)
    index = _flat_token_index(sources, vocab_size).to(device)
    mask = torch.zeros(batch_size * vocab_size, dtype=torch.bool, device=device)
    mask[index] = True
    return mask.view(batch_size, vocab_size)


def apply_penalties(logits: torch.Tensor, *, output_counts: torch.Tensor | None = None,
                    frequency_penalties: torch.Tensor | None = None,
                    presence_penalties: torch.Tensor | None = None, seen_mask: torch.Tensor | None = None,
                    repetition_penalties: torch.Tensor | None = None) -> torch.Tensor:
    """Penalized copy of `logits`; the input is never modified.

    logits:               [B, V] float32
    output_counts:        [B, V] int32, occurrences in the output (with frequency/presence penalties)
    frequency_penalties:  [B, 1] float32
    presence_penalties:   [B, 1] float32
    seen_mask:            [B, V] bool, token occurs in prompt or output (with repetition penalties)
    repetition_penalties: [B, 1] float32, > 0
    Returns `logits` itself when there is nothing to apply.
    """
    if seen_mask is not None:
        assert repetition_penalties is not None
        penalized = torch.where(logits > 0, logits / repetition_penalties, logits * repetition_penalties)
        logits = torch.where(seen_mask, penalized, logits)
    if output_counts is not None:
        assert frequency_penalties is not None and presence_penalties is not None
        counts = output_counts.to(logits.dtype)
        logits = (
            logits - frequency_penalties * counts - presence_penalties * (output_counts > 0).to(logits.dtype)
        )
    return logits
