"""What the speculative round asks of a draft model: DeepSeek's MTP module (models/mtp.py) or a test's stand-in."""

from __future__ import annotations

from typing import Protocol

import torch

from moeserve.core.forward_batch import ForwardBatch
from moeserve.kvcache.kv_pool import KVPool


class Drafter(Protocol):
    """A draft model with a KV pool of its own, addressed by the target's slots (slot s of a request's position
    p in the target's pool is that position's slot in the draft's pool too, so the draft needs no allocator).

    Row i of a batch (position p) reads the token after position p and the hidden state that predicted it: the
    target's at position p, or the draft's own output row of the step before when chaining drafts.
    """

    kv_pool: KVPool  # the draft's own pool (the memory line reports it)

    def forward(self, batch: ForwardBatch, input_ids: torch.Tensor, prev_hidden: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """batch: positions, slots and lengths (its input_ids are not read); input_ids [T] int64 on the device;
        prev_hidden [T, H]. Returns (logits float32 [rows of batch.logits_indices, V], hidden [T, H]), the hidden
        state of each row for the next draft step."""
        ...
