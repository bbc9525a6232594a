"""End-to-end greedy generation through the real scheduler and model runner, against transformers.

Every architecture: one mixed batch of prompts of different lengths, 32 new tokens each, token-identical to a
greedy loop over transformers' own model class on the same tiny random checkpoint (fp32, CPU). Then the same
with chunked prefill, with prefix-cache hits, with pages > 1 token, and with a KV pool so small that requests
are retracted and recomputed.
"""

from __future__ import annotations

import random

import pytest
import torch

from moeserve.rank.sampling_params import SamplingParams
from tests.checkpoints import NAMES, VOCAB, build_checkpoint, make_hf_model
from tests.rank.inprocess import InProcessEngine

NEW_TOKENS = 32
_HF_CACHE: dict[tuple, list[list[int]]] = {}


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    dirs: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in dirs:
            dirs[name] = build_checkpoint(name, tmp_path_factory.mktemp(name))
        return dirs[name]

    return get


def _prompts(seed: int, lengths: list[int], prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(2, VOCAB) for _ in range(n)] for n in lengths]


def hf_greedy(name: str, prompts: list[list[int]], n: int = NEW_TOKENS) -> list[list[int]]:
    """Greedy continuation by transformers' model (full forward each step, no EOS stop)."""
    key = (name, tuple(map(tuple, prompts)), n)
    if key not in _HF_CACHE:
        model = make_hf_model(name).eval()
        outs = []
        with torch.no_grad():
            for p in prompts:
                ids = torch.tensor([p])
                for _ in range(n):
                    nxt = model(ids).logits[0, -1].argmax()
                    ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
                outs.append(ids[0, len(p):].tolist())
        _HF_CACHE[key] = outs
    return _HF_CACHE[key]


NEAR_TIE = 1e-4  # a top-2 logit gap this small may flip with the reduction order (fp32, another device)


def assert_matches_hf(name: str, prompts: list[list[int]], got: list[list[int]]) -> None:
    """Our greedy tokens equal transformers', except that a sequence may take transformers' runner-up token where
    transformers' own top-2 logits are within NEAR_TIE (from there on the sequences differ by design)."""
    ref = hf_greedy(name, prompts, max(map(len, got), default=0))
    for p, g, r in zip(prompts, got, ref, strict=True):
        if g == r[:len(g)]:
            continue
        i = next(j for j, (a, b) in enumerate(zip(g, r, strict=False)) if a != b)
        with torch.no_grad():
            logits = make_hf_model(name).eval()(torch.tensor([p + r[:i]])).logits[0, -1]
        top = logits.topk(2)
        gap = float(top.values[0] - top.values[1])
        assert g[i] == int(top.indices[1]) and gap < NEAR_TIE, (
            f"prompt of {len(p)} tokens: token {i} is {g[i]}, transformers' is {r[i]} (its top-2 "
            f"{top.indices.tolist()} gap {gap:.2e}); ours {g}, transformers {r}")


GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
MIXED = [5, 17, 33, 9, 64, 2]


@pytest.mark.parametrize("name", NAMES)
def test_mixed_batch_matches_transformers(ckpt_dir, name):
    prompts = _prompts(1, MIXED)
    eng = InProcessEngine(model_path=ckpt_dir(name), chunked_prefill_size=-1, dtype="float32")
    assert_matches_hf(name, prompts, [r["output_ids"] for r in eng.run(prompts, GREEDY)])


@pytest.mark.parametrize("name", ["v3_q_lora", "mixtral"])
def test_grouped_gemm_experts_match_transformers(ckpt_dir, name):
    """The CPU default is moeserve's experts kernel (the test above); torch's grouped GEMM stays selectable."""
    prompts = _prompts(1, MIXED)
    eng = InProcessEngine(model_path=ckpt_dir(name), moe_runner_backend="grouped_gemm")
    assert_matches_hf(name, prompts, [r["output_ids"] for r in eng.run(prompts, GREEDY)])


@pytest.mark.parametrize("name", ["v3_q_lora", "qwen3_moe"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_matches(ckpt_dir, name, page_size):
    prompts = _prompts(1, MIXED)
    eng = InProcessEngine(model_path=ckpt_dir(name), chunked_prefill_size=8, page_size=page_size,
                          max_prefill_tokens=8)
    res = eng.run(prompts, GREEDY)
    assert_matches_hf(name, prompts, [r["output_ids"] for r in res])
    assert all(r["finish_reason"].type == "length" for r in res)


@pytest.mark.parametrize("name", ["v3_groups", "mixtral"])
def test_prefix_cache_hits(ckpt_dir, name):
    prefix = _prompts(7, [40])[0]
    first = _prompts(2, [3, 11], prefix)
    second = _prompts(3, [5, 8, 1], prefix)
    eng = InProcessEngine(model_path=ckpt_dir(name), page_size=4)
    r1 = eng.run(first, GREEDY)
    r2 = eng.run(second, GREEDY)
    assert_matches_hf(name, first, [r["output_ids"] for r in r1])
    assert_matches_hf(name, second, [r["output_ids"] for r in r2])
    assert all(r["cached_tokens"] >= 40 for r in r2)  # the 40-token prefix is 10 whole pages
    # an identical prompt reuses all whole pages but the last token
    r3 = eng.run([second[0]], GREEDY)
    assert r3[0]["cached_tokens"] == (len(second[0]) - 1) // 4 * 4
    assert r3[0]["output_ids"] == r2[0]["output_ids"]


@pytest.mark.parametrize("name", ["v3_q_lora", "v2_lite"])
def test_retraction_keeps_output(ckpt_dir, name):
    prompts = _prompts(4, [30, 25, 31, 28, 20, 26])
    eng = InProcessEngine(model_path=ckpt_dir(name), max_total_tokens=160, page_size=2,
                          new_token_ratio=0.0)
    res = eng.run(prompts, GREEDY)
    assert eng.scheduler.stats.retractions > 0
    assert_matches_hf(name, prompts, [r["output_ids"] for r in res])
    assert eng.scheduler.num_used_tokens == 0


def test_finish_reasons_and_abort(ckpt_dir):
    name = "v3_q_lora"
    prompts = _prompts(5, [12, 7])
    ref = hf_greedy(name, prompts)
    eng = InProcessEngine(model_path=ckpt_dir(name))
    stop_tok = ref[0][5]
    res = eng.run(prompts, [SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=[stop_tok],
                                           ignore_eos=True),
                            SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)])
    first_stop = ref[0].index(stop_tok)
    assert res[0]["output_ids"] == ref[0][: first_stop + 1]
    assert res[0]["finish_reason"].type == "stop" and res[0]["finish_reason"].matched == stop_tok
    assert res[1]["output_ids"] == ref[1][:3] and res[1]["finish_reason"].type == "length"
    # abort mid-generation frees every page it held
    from moeserve.rank.io_struct import GenerateReq
    from moeserve.rank.steps import run_step

    s = eng.scheduler
    free_before = s.allocator.num_free_pages + (s.cache.evictable_size if s.cache else 0)
    s.add_request(GenerateReq("victim", prompts[0], SamplingParams(max_new_tokens=100, ignore_eos=True)))
    for _ in range(3):
        run_step(s, eng.runner)
    assert s.num_used_tokens > 0
    s.abort("victim")
    outs = s.drain_pending()
    assert outs[-1].finish_reason.type == "abort"
    assert s.num_used_tokens == 0
    assert s.allocator.num_free_pages + s.cache.evictable_size == free_before
    assert s.flush_cache() and s.allocator.num_free_pages == s.allocator.num_pages


def test_bad_requests_are_rejected_cleanly(ckpt_dir):
    eng = InProcessEngine(model_path=ckpt_dir("mixtral"), max_total_tokens=256)
    res = eng.run([[], list(range(2, 600)), [3, 4, 5]],
                  [GREEDY, GREEDY, SamplingParams(max_new_tokens=1000, ignore_eos=True)])
    for r in res:
        assert r["finish_reason"].type == "abort" and r["finish_reason"].message
    ok = eng.run([[5, 6, 7]], GREEDY)
    assert len(ok[0]["output_ids"]) == NEW_TOKENS


def test_zero_new_tokens_and_non_finite_logits(ckpt_dir):
    """max_new_tokens 0 ends with no token (was one); NaN logits fail the request with status 500, the others go on."""
    eng = InProcessEngine(model_path=ckpt_dir("mixtral"))
    res = eng.run([[5, 6, 7], [8, 9]], [SamplingParams(max_new_tokens=0), GREEDY])
    assert res[0]["output_ids"] == [] and res[0]["finish_reason"].type == "length"
    assert len(res[1]["output_ids"]) == NEW_TOKENS

    forward = eng.runner.forward

    def nan_for_first_row(batch):
        logits = forward(batch).clone()
        logits[0] = float("nan")
        return logits

    eng.runner.forward = nan_for_first_row
    res = eng.run([[5, 6, 7]], GREEDY)
    finish = res[0]["finish_reason"]
    assert res[0]["output_ids"] == [] and finish.type == "abort" and finish.status_code == 500
    assert "non-finite" in finish.message
    eng.runner.forward = forward
    assert eng.scheduler.num_used_tokens == 0
    assert len(eng.run([[5, 6, 7]], GREEDY)[0]["output_ids"]) == NEW_TOKENS
