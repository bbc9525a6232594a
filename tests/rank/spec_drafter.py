"""A stand-in draft model for the speculative tests until an MTP module is loaded: a copy of the target with a
KV pool of its own, run on the drafter's rows as they come (row p reads the token after position p, so the copy
sees the sequence shifted by one). It ignores the hidden states it is handed. Its drafts are often right and
often wrong, which is what the round's tests need; `noise` makes them wronger."""

from __future__ import annotations

import copy
import dataclasses

import torch

from moeserve.core.forward_batch import ForwardBatch
from moeserve.kvcache.kv_pool import make_kv_pool


class ShiftedTargetDrafter:
    def __init__(self, runner, noise: float = 0.0, seed: int = 0):
        self.model = copy.deepcopy(runner.model)
        self.kv_pool = make_kv_pool(runner.config, runner.num_pages, runner.args.page_size, runner.dtype,
                                    runner.device)
        self.noise = noise
        self.gen = torch.Generator(device=runner.device).manual_seed(seed)
        self.calls = 0

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, input_ids: torch.Tensor, prev_hidden: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        assert prev_hidden.shape[0] == input_ids.shape[0]
        self.calls += 1
        fb = dataclasses.replace(batch, input_ids=input_ids, kv_pool=self.kv_pool)
        hidden = self.model.hidden_states(fb)
        logits = self.model.compute_logits(hidden, fb)
        if self.noise:
            logits = logits + self.noise * torch.randn(logits.shape, generator=self.gen, device=logits.device)
        return logits, hidden
