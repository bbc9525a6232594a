"""Our models against transformers' own classes on tiny random checkpoints and the shipped default model, float32
on CPU.

Tolerance: atol = rtol = 1e-4 on logits of magnitude ~1-5 (observed differences are ~3e-6: only the order of
float operations differs).
"""

from __future__ import annotations

import pytest
import torch

from moeserve.core.forward_batch import ForwardBatch
from tests.checkpoints import NAMES, SHIPPED
from tests.models.harness import ATOL, RTOL, Runner, hf_logits, random_tokens

close = dict(atol=ATOL, rtol=RTOL)


@pytest.fixture(params=(*NAMES, SHIPPED))
def name(request) -> str:
    return request.param


def test_prefill_all_positions(name, tiny_checkpoint, hf_model):
    runner = Runner(tiny_checkpoint(name))
    tokens = random_tokens(17, seed=1)
    ours = runner.extend([("a", tokens)], return_all_logits=True)
    assert ours.dtype == torch.float32 and ours.shape == (17, runner.config.vocab_size)
    torch.testing.assert_close(ours, hf_logits(hf_model(name), tokens), **close)


def test_prefill_default_rows_are_last_tokens(name, tiny_checkpoint):
    runner = Runner(tiny_checkpoint(name))
    a, b = random_tokens(6, seed=2), random_tokens(9, seed=3)
    last = runner.extend([("a", a), ("b", b)], return_all_logits=False)
    runner2 = Runner(tiny_checkpoint(name))
    full = runner2.extend([("a", a), ("b", b)], return_all_logits=True)
    torch.testing.assert_close(last, full[[5, 14]], atol=1e-5, rtol=1e-5)


def test_incremental_decode(name, tiny_checkpoint, hf_model):
    """Prefill, then one DECODE step at a time (MLA: absorbed form); each step equals HF on the whole sequence."""
    runner, hf = Runner(tiny_checkpoint(name)), hf_model(name)
    tokens = random_tokens(7, seed=4)
    runner.extend([("a", tokens)])
    for step, tok in enumerate(random_tokens(6, seed=5)):
        tokens = tokens + [tok]
        ours = runner.decode([("a", tok)])
        torch.testing.assert_close(ours[0], hf_logits(hf, tokens)[-1], **close, msg=f"decode step {step}")


def test_chunked_prefill_equals_one_shot(name, tiny_checkpoint, hf_model):
    tokens = random_tokens(19, seed=6)
    one_shot = Runner(tiny_checkpoint(name)).extend([("a", tokens)])
    chunked = Runner(tiny_checkpoint(name))
    first = chunked.extend([("a", tokens[:8])])
    second = chunked.extend([("a", tokens[8:15])])
    third = chunked.extend([("a", tokens[15:])])
    torch.testing.assert_close(torch.cat([first, second, third]), one_shot, **close)
    torch.testing.assert_close(one_shot, hf_logits(hf_model(name), tokens), **close)


def test_ragged_batch(name, tiny_checkpoint, hf_model):
    """Several requests of different lengths (one with a cached prefix) in one EXTEND, then one DECODE step."""
    hf = hf_model(name)
    runner = Runner(tiny_checkpoint(name))
    prompts = {"a": random_tokens(5, seed=7), "b": random_tokens(11, seed=8), "c": random_tokens(1, seed=9),
               "d": random_tokens(13, seed=10)}
    runner.extend([("d", prompts["d"][:6])])  # d has a 6-token prefix in the cache
    order = ["a", "b", "c", "d"]
    new = {r: prompts[r][6:] if r == "d" else prompts[r] for r in order}
    logits = runner.extend([(r, new[r]) for r in order])
    start = 0
    for r in order:
        n = len(new[r])
        ref = hf_logits(hf, prompts[r])[-n:]
        torch.testing.assert_close(logits[start:start + n], ref, **close, msg=f"request {r}")
        start += n
    nxt = {r: t for r, t in zip(order, random_tokens(4, seed=11), strict=True)}
    logits = runner.decode([(r, nxt[r]) for r in order])
    for i, r in enumerate(order):
        torch.testing.assert_close(logits[i], hf_logits(hf, prompts[r] + [nxt[r]])[-1], **close, msg=f"decode {r}")


def test_greedy_generation_matches_hf_generate(name, tiny_checkpoint, hf_model):
    hf = hf_model(name)
    runner = Runner(tiny_checkpoint(name))
    prompt = random_tokens(8, seed=12)
    eos = set(runner.config.eos_token_ids)
    out: list[int] = []
    tok = int(runner.extend([("a", prompt)], return_all_logits=False)[0].argmax())
    while True:
        out.append(tok)
        if tok in eos or len(out) == 32:
            break
        tok = int(runner.decode([("a", tok)])[0].argmax())
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=0)
    assert out == ref[0, len(prompt):].tolist()


def test_idle_batch_runs_through(name, tiny_checkpoint):
    """T = 0: every layer runs (MoE layers still call the dispatcher) and the logits are empty."""
    runner = Runner(tiny_checkpoint(name))
    seen: list[tuple[int, tuple]] = []

    class Recorder:
        def on_select_experts(self, layer_id, topk_ids):
            seen.append((layer_id, tuple(topk_ids.shape)))

    runner.model.set_expert_recorder(Recorder())
    try:
        with torch.no_grad():
            logits = runner.model(ForwardBatch.idle(runner.pool))
    finally:
        runner.model.set_expert_recorder(None)
    assert logits.shape == (0, runner.config.vocab_size)
    k = runner.config.num_experts_per_tok
    assert seen == [(i, (0, k)) for i in runner.config.moe_layers]
