"""DeepSeek's MTP layer (models/mtp.py) as the round's draft model: its KV pool as large as the target's, a
position's draft KV in the slot its target KV has (drafter.py)."""

from __future__ import annotations

import dataclasses

import torch

from moeserve.core.forward_batch import ForwardBatch
from moeserve.kvcache.kv_pool import KVPool
from moeserve.models.mtp import MTPModel


class MTPDrafter:
    def __init__(self, mtp: MTPModel, kv_pool: KVPool):
        self.mtp, self.kv_pool = mtp, kv_pool

    def forward(self, batch: ForwardBatch, input_ids: torch.Tensor, prev_hidden: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mtp(dataclasses.replace(batch, kv_pool=self.kv_pool), input_ids, prev_hidden)
