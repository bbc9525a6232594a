"""Prompt logprobs (rank/prompt_logprobs.py) through the real scheduler and model runner, against transformers'
log-softmax of its own logits on a tiny random DeepSeek-V3 checkpoint: whole prefill, chunked prefill, prefix-cache
hits (the scored positions are computed, the rest still shared), max_new_tokens = 0, and a bad start refused."""

from __future__ import annotations

import random

import pytest
import torch

from moeserve.rank.sampling_params import SamplingParams
from tests.checkpoints import VOCAB, build_checkpoint
from tests.rank.inprocess import InProcessEngine

ATOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return build_checkpoint("v3_groups", tmp_path_factory.mktemp("v3_groups"))


@pytest.fixture(scope="module")
def hf(ckpt):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB) for _ in range(n)]


def _reference(hf, prompt: list[int]) -> torch.Tensor:
    """[len, V] log-probabilities: row p is the distribution of token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


def _check(result: dict, prompt: list[int], start: int, ref: torch.Tensor, top_n: int = 0) -> None:
    got = result["input_logprobs"]
    assert got is not None and len(got) == len(prompt) - start
    for k, lp in enumerate(got):
        i = start + k
        if i == 0:
            assert lp is None
            continue
        assert abs(lp - ref[i - 1, prompt[i]].item()) < ATOL, (i, lp, ref[i - 1, prompt[i]].item())
    if top_n:
        tops = result["input_top_logprobs"]
        assert len(tops) == len(got)
        for k, alts in enumerate(tops):
            i = start + k
            if i == 0:
                assert alts == []
                continue
            values, ids = ref[i - 1].topk(top_n)
            assert [t for t, _ in alts] == ids.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in alts]), values, atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunk", [-1, 7])
def test_prompt_logprobs_equal_transformers(ckpt, hf, chunk):
    eng = InProcessEngine(model_path=ckpt, dtype="float32", chunked_prefill_size=chunk, page_size=4)
    prompts = [_prompt(1, 23), _prompt(2, 9), _prompt(3, 1)]
    starts = [0, 5, 0]
    for prompt, start in zip(prompts, starts, strict=True):
        (out,) = eng.run([prompt], SamplingParams(max_new_tokens=3, temperature=0), return_logprob=True,
                         top_logprobs_num=3, logprob_start_len=start)
        _check(out, prompt, start, _reference(hf, prompt), top_n=3)
        assert len(out["output_ids"]) == 3 and len(out["logprobs"]) == 3
    # several at once, in one EXTEND (rows of different requests interleave with the sampling rows)
    outs = eng.run(prompts, SamplingParams(max_new_tokens=2, temperature=0), return_logprob=True,
                   logprob_start_len=0)
    for prompt, out in zip(prompts, outs, strict=True):
        _check(out, prompt, 0, _reference(hf, prompt))


def test_cached_prefix_is_scored_not_skipped(ckpt, hf):
    eng = InProcessEngine(model_path=ckpt, dtype="float32", page_size=4)
    shared = _prompt(4, 16)
    prompt = shared + _prompt(5, 6)
    eng.run([shared + _prompt(6, 3)], SamplingParams(max_new_tokens=1))  # leaves `shared` in the radix cache
    (plain,) = eng.run([prompt], SamplingParams(max_new_tokens=1))
    assert plain["cached_tokens"] == 16
    ref = _reference(hf, prompt)
    (scored,) = eng.run([prompt], SamplingParams(max_new_tokens=1), return_logprob=True, logprob_start_len=0)
    assert scored["cached_tokens"] == 0
    _check(scored, prompt, 0, ref)
    (tail,) = eng.run([prompt], SamplingParams(max_new_tokens=1), return_logprob=True, logprob_start_len=11)
    assert tail["cached_tokens"] == 8  # positions 10.. are scored: the cache gives whole pages before them
    _check(tail, prompt, 11, ref)


def test_max_new_tokens_zero_scores_the_prompt_only(ckpt, hf):
    eng = InProcessEngine(model_path=ckpt, dtype="float32", chunked_prefill_size=6)
    prompt = _prompt(7, 14)
    (out,) = eng.run([prompt], SamplingParams(max_new_tokens=0), return_logprob=True, logprob_start_len=0)
    assert out["output_ids"] == [] and out["finish_reason"].type == "length"
    _check(out, prompt, 0, _reference(hf, prompt))
    assert not eng.scheduler.has_work() and not eng.scheduler.reqs
    (again,) = eng.run([prompt], SamplingParams(max_new_tokens=2, temperature=0))  # its KV went to the cache
    assert again["cached_tokens"] > 0


def test_start_past_the_prompt_is_refused(ckpt):
    eng = InProcessEngine(model_path=ckpt, dtype="float32")
    (out,) = eng.run([_prompt(8, 5)], SamplingParams(max_new_tokens=1), return_logprob=True, logprob_start_len=5)
    assert out["finish_reason"].type == "abort" and "logprob_start_len" in out["finish_reason"].message
