"""MLA's extend in the absorbed form (layers/attention/latent_extend.py) against the expanded form, the same step
run both ways in float32 (both write the same latent rows to the same slots): every row's logits agree, for fresh
prompts, short tails over long cached prefixes, ragged batches mixing both, and a prompt prefilled in chunks
against the same prompt in one step. On random tiny DeepSeek-V3 / V2 checkpoints and the shipped default model.

The expanded form is the reference: test_parity.py checks the model against transformers (on these tiny shapes
the cost rule runs the absorbed form there too, so that test covers it against an independent implementation)."""

from __future__ import annotations

import pytest
import torch

import moeserve.models.deepseek as deepseek
from moeserve.core.forward_batch import ForwardMode
from moeserve.kernels import cpu_isa, cpu_latent_extend
from moeserve.layers.attention import latent_extend
from moeserve.layers.attention.extend_plan import ExtendGroup, ExtendPlan
from moeserve.layers.attention.latent_extend import MLAShape, absorbed_requests, query_key_pairs
from moeserve.models.default_model import default_model_path
from tests.models.harness import ATOL, RTOL, Runner, random_tokens

MODELS = ["v3_q_lora", "v3_no_q_lora", "v2_lite", "default"]


def _path(tiny_checkpoint, name: str) -> str:
    return str(default_model_path()) if name == "default" else tiny_checkpoint(name)


def _run(runner: Runner, batch, absorbed: bool, monkeypatch) -> torch.Tensor:
    """The step's logits [T, V] with every MLA layer's extend forced into one form; checks the form ran."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return latent_extend.absorbed_extend(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(deepseek, "absorbed_requests", lambda shape, plan, ext, seq, q: [absorbed] * len(ext))
        m.setattr(deepseek, "absorbed_extend", spy)
        with torch.no_grad():
            logits = runner.model(batch)
    assert len(calls) == (runner.config.num_hidden_layers if absorbed else 0)
    return logits


def _both(runner: Runner, reqs: list[tuple[object, list[int]]], monkeypatch) -> None:
    batch = runner.batch(ForwardMode.EXTEND, reqs, return_all_logits=True)
    expanded = _run(runner, batch, False, monkeypatch)
    absorbed = _run(runner, batch, True, monkeypatch)
    assert expanded.shape[0] == sum(len(t) for _, t in reqs)
    torch.testing.assert_close(absorbed, expanded, atol=ATOL, rtol=RTOL)
    assert expanded.std() > 1e-3  # (not a degenerate model)


def _cached(runner: Runner, lengths: dict[object, int], seed: int) -> None:
    """Requests' prefixes written to the cache (an extend, the expanded form)."""
    vocab = runner.config.vocab_size
    runner.extend([(rid, random_tokens(n, seed + i, vocab)) for i, (rid, n) in enumerate(lengths.items())])


@pytest.mark.parametrize("name", MODELS)
def test_fresh_prompts(tiny_checkpoint, name, monkeypatch):
    runner = Runner(_path(tiny_checkpoint, name))
    vocab = runner.config.vocab_size
    _both(runner, [(i, random_tokens(n, 10 + i, vocab)) for i, n in enumerate([5, 17, 1, 33])], monkeypatch)


@pytest.mark.parametrize("name", MODELS)
def test_short_tails_over_long_prefixes(tiny_checkpoint, name, monkeypatch):
    runner = Runner(_path(tiny_checkpoint, name))
    _cached(runner, {0: 120, 1: 75, 2: 200}, seed=20)
    vocab = runner.config.vocab_size
    _both(runner, [(0, random_tokens(3, 30, vocab)), (1, random_tokens(1, 31, vocab)),
                   (2, random_tokens(9, 32, vocab))], monkeypatch)


@pytest.mark.parametrize("name", MODELS)
def test_mixed_prefixes_and_fresh_prompts_in_one_batch(tiny_checkpoint, name, monkeypatch):
    """Ragged: long and short prefixes, long and short tails, fresh prompts, in no sorted order."""
    runner = Runner(_path(tiny_checkpoint, name))
    _cached(runner, {"a": 150, "b": 20, "c": 64}, seed=40)
    vocab = runner.config.vocab_size
    step = [("b", 30), ("new1", 12), ("a", 4), ("new2", 1), ("c", 64), ("new3", 40)]
    _both(runner, [(rid, random_tokens(n, 50 + i, vocab)) for i, (rid, n) in enumerate(step)], monkeypatch)


@pytest.mark.parametrize("name", MODELS)
def test_requests_of_both_forms_in_one_step(tiny_checkpoint, name, monkeypatch):
    """The form is chosen per request: a step whose requests part runs each form over its own requests (their rows
    gathered, their own slots and plan) and gives every row the all-expanded step's logits."""
    runner = Runner(_path(tiny_checkpoint, name))
    _cached(runner, {"a": 150, "b": 20, "c": 64}, seed=80)
    vocab = runner.config.vocab_size
    step = [("b", 30), ("new1", 12), ("a", 4), ("new2", 1), ("c", 64), ("new3", 40)]
    batch = runner.batch(ForwardMode.EXTEND, [(rid, random_tokens(n, 90 + i, vocab)) for i, (rid, n) in
                                              enumerate(step)], return_all_logits=True)
    expanded = _run(runner, batch, False, monkeypatch)
    forms, calls = [True, False, False, True, True, False], []

    def spy(q_nope, *args, **kwargs):
        calls.append(q_nope.shape[0])
        return latent_extend.absorbed_extend(q_nope, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(deepseek, "absorbed_requests", lambda shape, plan, ext, seq, q: list(forms))
        m.setattr(deepseek, "absorbed_extend", spy)
        with torch.no_grad():
            split = runner.model(batch)
    absorbed_rows = sum(n for (_, n), f in zip(step, forms, strict=True) if f)
    assert calls == [absorbed_rows] * runner.config.num_hidden_layers  # each layer: the absorbed requests' rows
    torch.testing.assert_close(split, expanded, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", MODELS)
def test_chunked_prefill_equals_one_step(tiny_checkpoint, name, monkeypatch):
    """A prompt in chunks, absorbed (each chunk over the ones before it), against the whole prompt in one expanded
    step: the same logits for every position."""
    runner = Runner(_path(tiny_checkpoint, name))
    tokens = random_tokens(90, 60, runner.config.vocab_size)
    whole = _run(runner, runner.batch(ForwardMode.EXTEND, [("whole", tokens)], return_all_logits=True), False,
                 monkeypatch)
    chunks, at = [], 0
    for n in (32, 7, 40, 11):
        batch = runner.batch(ForwardMode.EXTEND, [("chunked", tokens[at:at + n])], return_all_logits=True)
        chunks.append(_run(runner, batch, True, monkeypatch))
        at += n
    torch.testing.assert_close(torch.cat(chunks), whole, atol=ATOL, rtol=RTOL)


def test_a_causal_offset_off_by_one_is_seen(tiny_checkpoint, monkeypatch):
    """The comparison above fails when the absorbed form lets each query see one key too many (the torch form's
    mask shifted; the CPU kernel's own offsets are checked against its float64 reference in
    test_cpu_latent_extend.py)."""
    monkeypatch.setattr(cpu_latent_extend, "takes", lambda q, cache: False)
    real_bias = ExtendGroup.bias

    def one_late(group):
        b = real_bias(group)
        return torch.cat((torch.zeros_like(b[..., :1]), b[..., :-1]), dim=-1)

    runner = Runner(tiny_checkpoint("v3_q_lora"))
    _cached(runner, {0: 40}, seed=70)
    batch = runner.batch(ForwardMode.EXTEND, [(0, random_tokens(6, 71))], return_all_logits=True)
    expanded = _run(runner, batch, False, monkeypatch)
    monkeypatch.setattr(ExtendGroup, "bias", one_late)
    absorbed = _run(runner, batch, True, monkeypatch)
    assert not torch.allclose(absorbed, expanded, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("native_bf16", [True, False])
def test_cost_rule(native_bf16, monkeypatch):
    """Absorbed for a short tail over a long prefix, expanded for a long fresh prompt at DeepSeek-V3's widths in
    float32; in bf16 a fresh prompt of 256 tokens expanded where torch's bf16 GEMMs run on bf16 dot products and
    absorbed where they do not; the default model's multi-turn shape (100 new over 1,000 cached) and its fresh
    prompts absorbed in float32 (the CPU server's dtype) and bf16; never off the CPU, nor with CUDA's kernel plan."""
    monkeypatch.setattr(cpu_isa, "native_bf16", lambda: native_bf16)
    v3 = MLAShape(heads=128, kv_lora=512, rope=64, nope=128, v=128)

    def pays(shape, ext, seq, dtype=torch.bfloat16, device="cpu"):
        queries = torch.empty(0, dtype=dtype, device=device)
        return all(absorbed_requests(shape, ExtendPlan.build(ext, seq, "cpu"), ext, seq, queries))

    for dtype in (torch.bfloat16, torch.float32):
        assert pays(v3, [16], [4096], dtype)
    assert not pays(v3, [2048], [2048], torch.float32) and not pays(v3, [4096], [8192], torch.float32)
    assert pays(v3, [256], [256]) is not native_bf16 and not pays(v3, [256], [256], torch.float32)
    default = MLAShape(heads=4, kv_lora=64, rope=16, nope=32, v=32)
    for dtype in (torch.bfloat16, torch.float32):
        assert pays(default, [100, 90], [1100, 1000], dtype) and pays(default, [1024], [1024], dtype)
    kernel_plan = ExtendPlan.build([16], [4096], "cpu", kernel=True)
    assert absorbed_requests(v3, kernel_plan, [16], [4096], torch.empty(0)) == [False]
    # per request: a short tail over a long prefix beside a long fresh prompt, each its own form
    assert absorbed_requests(v3, ExtendPlan.build([16, 4096], [4096, 8192], "cpu"), [16, 4096], [4096, 8192],
                             torch.empty(0)) == [True, False]
    assert not pays(v3, [16], [4096], device="meta")  # any device but the CPU keeps the expanded form


def test_query_key_pairs():
    ext, seq = [3, 1, 5], [10, 1, 5]
    brute = sum(s - n + i + 1 for n, s in zip(ext, seq, strict=True) for i in range(n))
    assert query_key_pairs(ext, seq) == brute


def test_score_blocks(tiny_checkpoint, monkeypatch):
    """Query rows in several blocks of scores (a small SCORE_BYTES) give what one block gives."""
    runner = Runner(tiny_checkpoint("v2_lite"))
    _cached(runner, {0: 50, 1: 9}, seed=80)
    batch = runner.batch(ForwardMode.EXTEND, [(0, random_tokens(13, 81)), (1, random_tokens(20, 82))],
                         return_all_logits=True)
    whole = _run(runner, batch, True, monkeypatch)
    monkeypatch.setattr(latent_extend, "SCORE_BYTES", 3 * 4 * 4 * 70)  # 3 query rows of 4 heads over 70 keys
    torch.testing.assert_close(_run(runner, batch, True, monkeypatch), whole, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", ["v2_lite", "default"])
def test_query_blocks_read_only_the_keys_they_see(tiny_checkpoint, name, monkeypatch):
    """Query blocks of 4 rows, each reading the keys up to the last one its rows see: a fresh prompt (a dense
    causal group) and a ragged batch over cached prefixes (a padded group) equal the expanded form."""
    runner = Runner(_path(tiny_checkpoint, name))
    monkeypatch.setattr(latent_extend, "QUERY_BLOCK", 4)
    _both(runner, [(0, random_tokens(30, 90))], monkeypatch)
    _cached(runner, {1: 37, 2: 5}, seed=91)
    _both(runner, [(1, random_tokens(11, 92)), (2, random_tokens(23, 93)), (3, random_tokens(9, 94))], monkeypatch)


def test_fp8_kv_b_keeps_extends_expanded(fp8_checkpoint, monkeypatch):
    """An FP8 kv_b_proj: a short tail over a long prefix, which the rule would run absorbed, runs expanded (the two
    forms are an e4m3 step apart there, so a prompt's rounding would follow its chunking)."""
    runner = Runner(fp8_checkpoint[0])
    _cached(runner, {0: 150}, seed=95)
    batch = runner.batch(ForwardMode.EXTEND, [(0, random_tokens(3, 96, runner.config.vocab_size))])
    plan = ExtendPlan.build([3], [153], "cpu")
    assert all(absorbed_requests(runner.model.model.layers[0].self_attn.shape, plan, [3], [153], torch.empty(0)))
    calls = []
    monkeypatch.setattr(deepseek, "absorbed_extend", lambda *a, **k: calls.append(1))
    with torch.no_grad():
        runner.model(batch)
    assert calls == []
