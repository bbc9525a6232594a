"""The EPLB expert weight source hands out exactly the weights the loader put in each slot: from host memory, from
the memory-mapped checkpoint, and drawn again for dummy weights."""

from __future__ import annotations

import pytest
import torch

from moeserve.args import ServerArgs
from moeserve.layers.moe.layer import MoE
from moeserve.models.expert_weights import expert_source
from moeserve.models.loader import load_model


@pytest.mark.parametrize(("name", "load_format", "mode"), [("v3_groups", "auto", "memory"),
                                                           ("v3_groups", "auto", "mmap"),
                                                           ("mixtral", "auto", "mmap"),
                                                           ("v3_groups", "dummy", "memory")])
def test_source_equals_loaded_slots(tiny_checkpoint, name, load_format, mode):
    path = tiny_checkpoint(name)
    model, _ = load_model(ServerArgs(model_path=path, load_format=load_format, dtype="float32"),
                          torch.device("cpu"), show_progress=False)
    source = expert_source(model, path, load_format, mode, seed=0)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for i, moe in enumerate(moes):
        w13, w2 = moe.slot_weights()
        for slot, logical in enumerate(moe.experts.expert_ids):
            a, b = source(i, logical)
            assert torch.equal(a, w13[slot]) and torch.equal(b, w2[slot]), (i, slot, logical)


def test_unknown_mode_is_refused(tiny_checkpoint):
    path = tiny_checkpoint("v3_groups")
    model, _ = load_model(ServerArgs(model_path=path, dtype="float32"), torch.device("cpu"), show_progress=False)
    with pytest.raises(ValueError, match="memory, mmap"):
        expert_source(model, path, "auto", "disk", seed=0)
