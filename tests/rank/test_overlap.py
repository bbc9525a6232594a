"""Overlap scheduling (rank/steps.py): the same tokens as back-to-back steps, with steps really in flight.

On the embedded default model (trained: requests end on EOS, so a request finishes while its next step is
already launched), fp32 on CPU: a batch mixing stop strings, penalties (back-to-back steps), lengths of 1 to 48
tokens and streaming; the same with logprobs and top logprobs; a KV pool small enough to retract; an abort while
a step is in flight. Every request's tokens and finish reason equal those of --disable-overlap-schedule, and no KV page is
lost.
"""

from __future__ import annotations

import random

import pytest

from moeserve.models.default_model import default_model_path
from moeserve.rank.io_struct import GenerateReq
from moeserve.rank.request import FUTURE_TOKEN
from moeserve.rank.sampling_params import SamplingParams
from moeserve.text.tokenizer import load_tokenizer
from tests.rank.inprocess import InProcessEngine

TEXTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "def fib(n):", "Hello! How are you",
         "The quick brown fox", "In 1492,", "Water boils at", "My favourite colour is", "Q: What is 7 + 5?\nA:"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def _engines(tokenizer, **kw):
    kw.setdefault("max_total_tokens", 8192)  # two engines side by side (on a GPU: not a share of its memory each)
    return [InProcessEngine(tokenizer, model_path=default_model_path(), dtype="float32",
                            disable_overlap_schedule=off, **kw) for off in (False, True)]


def _params(seed: int) -> list[SamplingParams]:
    rng = random.Random(seed)
    out = []
    for i in range(len(TEXTS)):
        kw = {"max_new_tokens": rng.choice([1, 3, 17, 48]), "temperature": 0.0}
        if i % 4 == 1:
            kw["stop"] = [" the", "\n"]
        if i == 6:
            kw["frequency_penalty"] = 0.5  # its decode steps run back to back
        if i == 7:
            kw.update(temperature=0.8, seed=7)
        out.append(SamplingParams(**kw))
    return out


def _no_lost_pages(eng: InProcessEngine) -> None:
    s = eng.scheduler
    assert not s.running and not s.reqs
    cached = s.cache.evictable_size if s.cache else 0
    assert s.allocator.num_free_pages * s.page_size + cached == s.allocator.num_pages * s.page_size


@pytest.mark.parametrize("logprobs", [False, True])
def test_overlap_equals_back_to_back(tokenizer, logprobs):
    on, off = _engines(tokenizer)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    params = _params(0)
    got, want = (e.run(prompts, params, return_logprob=logprobs, top_logprobs_num=2 * logprobs) for e in (on, off))
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert [g["finish_reason"].type for g in got] == [w["finish_reason"].type for w in want]
    assert any(w["finish_reason"].type == "stop" for w in want)  # some requests end on EOS or a stop string
    if logprobs:  # they travel to the host with the tokens of a step in flight
        flat = [[x for g in side for x in g["logprobs"]] for side in (got, want)]
        assert flat[0] == pytest.approx(flat[1])
        tops = [[alt for g in side for step in g["top_logprobs"] for alt in step] for side in (got, want)]
        assert [i for i, _ in tops[0]] == [i for i, _ in tops[1]] and len(tops[0]) == 2 * len(flat[0])
        assert [v for _, v in tops[0]] == pytest.approx([v for _, v in tops[1]])
    assert on.steps.num_overlapped > 10 and off.steps.num_overlapped == 0
    for e in (on, off):
        _no_lost_pages(e)


def test_overlap_with_retractions(tokenizer):
    on, off = _engines(tokenizer, max_total_tokens=192, page_size=4)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(8, 24))] for _ in range(8)]
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    got, want = on.run(prompts, params), off.run(prompts, params)
    assert on.scheduler.stats.retractions > 0
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert on.steps.num_overlapped > 0
    _no_lost_pages(on)


def test_abort_while_in_flight(tokenizer):
    on, off = _engines(tokenizer)
    prompts = [tokenizer.encode(t) for t in TEXTS[:3]]
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    want = off.run(prompts, params)
    s = on.scheduler
    for i, p in enumerate(prompts):
        s.add_request(GenerateReq(f"a{i}", p, params))
    got = {f"a{i}": [] for i in range(3)}
    finished = {}
    while s.has_work() or on.steps.busy:
        for o in on.steps.step() + s.drain_pending():
            got[o.rid] += o.new_token_ids
            if o.finish_reason is not None:
                finished[o.rid] = o.finish_reason.type
        if on.steps.busy and "a1" in s.reqs and len(s.reqs["a1"].output_ids) >= 6:
            s.abort("a1")
    assert finished == {"a0": "length", "a1": "abort", "a2": "length"}
    assert got["a0"] == want[0]["output_ids"] and got["a2"] == want[2]["output_ids"]
    assert FUTURE_TOKEN not in got["a1"] and got["a1"] == want[1]["output_ids"][:len(got["a1"])]
    _no_lost_pages(on)


class _DpGroupRank:
    """One rank of two DP attention groups (attention TP 1), as rank_sync.RankSync looks to the pipeline: the other
    group reports `other` tokens at every step."""

    multi, group_size, is_leader = True, 1, True

    def __init__(self, other: int):
        self.other, self.headers = other, []

    def exchange_header(self, num_tokens, is_extend, stop=False, eplb=0, static_ok=False, verify=False,
                        static_extend_ok=False):
        from moeserve.rank.rank_sync import StepHeader

        self.headers.append(num_tokens)
        return StepHeader([num_tokens, self.other], is_extend, stop, [0, 0])

    def share_sample(self, sample):
        return sample


def test_dp_attention_ranks_overlap(tokenizer):
    """A DP attention rank overlaps: one header a step, the step before still in flight; the same tokens as back to
    back; with nothing of its own it joins the other group's step with an IDLE forward. An attention TP group does
    not overlap (its ranks share the leader's tokens on the host)."""
    from moeserve.rank.steps import StepPipeline

    on, off = _engines(tokenizer)
    group = _DpGroupRank(other=5)
    on.steps = StepPipeline(on.scheduler, on.runner, group, overlap=True)
    assert on.steps.overlap
    prompts = [tokenizer.encode(t) for t in TEXTS[:6]]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    got, want = on.run(prompts, params), off.run(prompts, params)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert on.steps.num_overlapped > 5
    modes = []
    forward = on.runner.forward
    on.runner.forward = lambda fb: (modes.append((fb.mode.name, fb.global_num_tokens)), forward(fb))[1]
    steps_before = len(group.headers)
    assert on.steps.step() == [] and on.steps.step() == []
    assert len(group.headers) == steps_before + 2 and modes == [("IDLE", [0, 5])] * 2
    group.other = 0
    assert on.steps.step() == [] and len(modes) == 2  # no group has work: nobody runs
    assert on.steps.step(stop=True) is None and len(group.headers) == steps_before + 4  # the stop goes round too
    _no_lost_pages(on)
    tp_group = _DpGroupRank(other=0)
    tp_group.group_size = 2
    assert not StepPipeline(on.scheduler, on.runner, tp_group, overlap=True).overlap
