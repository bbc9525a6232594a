"""The recorder counts exactly the routed tokens of real rows: padded batches (rows as the graph runners pad them:
token 0 at position 0, written to the scratch slot 0), idle batches and passes under `not_counting` (start-up
warm-ups and captures) add nothing, in every mode. The reference is the router's own top-k on the same forward,
read from the gates and kept for the real rows only."""

from __future__ import annotations

import pytest
import torch

from moeserve.core.forward_batch import ForwardBatch, ForwardMode
from moeserve.eplb.recorder import RECORDER_MODES, ExpertDistributionRecorder
from tests.models.harness import Runner, random_tokens


def _padded(runner: Runner, mode: ForwardMode, reqs: list[tuple[object, list[int]]], pad_rows: int) -> ForwardBatch:
    """The batch of `reqs`, then `pad_rows` padding requests the way CudaGraphRunner pads a decode batch
    (PiecewiseGraphRunner's padding tokens look the same)."""
    return runner.batch(mode, reqs, pad_rows=pad_rows)


@pytest.mark.parametrize("mode", RECORDER_MODES)
def test_counts_are_the_real_rows_routed_tokens(mode, tiny_checkpoint):
    runner = Runner(tiny_checkpoint("v3_groups"))
    cfg = runner.config
    k = cfg.num_experts_per_tok
    rec = ExpertDistributionRecorder(cfg.moe_layers, cfg.num_experts, "cpu", mode, buffer_size=1000, top_k=k,
                                     max_rows_per_pass=64)
    runner.model.set_expert_recorder(rec)
    seen: dict[int, list[torch.Tensor]] = {layer: [] for layer in cfg.moe_layers}
    for moe in runner.model.moe_layers():
        moe.gate.register_forward_hook(
            lambda mod, args, out, layer=moe.layer_id: seen[layer].append(out[0][:, :k].clone()))

    g = torch.Generator().manual_seed(7)
    expected = torch.zeros(len(cfg.moe_layers), cfg.num_experts, dtype=torch.int64)
    tokens: list[torch.Tensor] = []  # [real rows, layers, k] per pass, for per_token
    rec.start()
    with torch.no_grad():
        with rec.not_counting():  # a warm-up: counted nowhere
            runner.model(_padded(runner, ForwardMode.EXTEND, [("w", random_tokens(5, 99))], 3))
        for layer in seen:
            seen[layer].clear()
        steps = [(ForwardMode.EXTEND, [(r, random_tokens(int(n), r)) for r, n in enumerate(torch.randint(1, 9, (3,),
                                                                                              generator=g))])]
        steps += [(ForwardMode.DECODE, [(r, int(torch.randint(1, 500, (1,), generator=g))) for r in range(3)])
                  for _ in range(4)]
        for step, (fmode, reqs) in enumerate(steps):
            pad = int(torch.randint(0, 5, (1,), generator=g))
            reqs = [(r, t if isinstance(t, list) else [t]) for r, t in reqs]
            real = sum(len(t) for _, t in reqs)
            runner.model(_padded(runner, fmode, reqs, pad))
            rec.on_pass_end(real)
            ids = torch.stack([seen[layer][-1][:real] for layer in cfg.moe_layers], dim=1)  # [real, layers, k]
            assert all(seen[layer][-1].shape[0] == real + pad for layer in cfg.moe_layers)
            tokens.append(ids)
            for i in range(len(cfg.moe_layers)):
                expected[i] += torch.bincount(ids[:, i].reshape(-1), minlength=cfg.num_experts)
            if step == 2:  # an idle DP group's passes: no rows, or only padding rows (a graph's batch size)
                for idle in (ForwardBatch.idle(runner.pool), _padded(runner, ForwardMode.DECODE, [], 4)):
                    runner.model(idle)
                    rec.on_pass_end(0)
                    tokens.append(torch.zeros(0, len(cfg.moe_layers), k, dtype=torch.int64))
    rec.stop()
    assert expected.sum() > 0
    assert torch.equal(rec.window(), expected)
    dump = rec.dump()
    if mode == "per_pass":
        per_pass = torch.stack([torch.stack([torch.bincount(t[:, i].reshape(-1), minlength=cfg.num_experts)
                                             for i in range(len(cfg.moe_layers))]) for t in tokens])
        assert torch.equal(dump["logical_count"], per_pass)
    else:
        assert torch.equal(dump["logical_count"][0], expected)
    if mode == "per_token":
        assert torch.equal(dump["topk_ids"], torch.cat(tokens))
