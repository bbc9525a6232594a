"""Speculative rounds on one rank (rank/speculative/round.py) through the real scheduler and model runner: greedy
tokens identical with speculation on and off, whatever the drafts' quality, with continuous batching (different
accept lengths in one step), chunked prefill, prefix hits, pages > 1 token, EOS and max_tokens inside an accepted
run, logprobs of the accepted tokens, aborts; the KV pool's free pages return to their start.

The draft model is tests/rank/spec_drafter.py's stand-in (a shifted copy of the target) until the MTP module
loads."""

from __future__ import annotations

import random

import pytest
import torch

from moeserve.constrained.registry import make_grammar_backend
from moeserve.rank.io_struct import GenerateReq
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


def spec_engine(k: int, noise: float = 0.0, tokenizer=None, **kwargs) -> InProcessEngine:
    eng = InProcessEngine(tokenizer=tokenizer, **kwargs)
    eng.runner.enable_speculation(ShiftedTargetDrafter(eng.runner, noise), k)
    eng.scheduler = Scheduler(eng.args, eng.runner.num_pages, eng.runner.context_length,
                              eng.runner.config.eos_token_ids, tokenizer=tokenizer,
                              grammar=make_grammar_backend(eng.args.grammar_backend, tokenizer, eng.runner.vocab_size),
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
    for r in got:  # one token from the prefill, then 1 to k + 1 per verify step
        n = len(r["output_ids"]) - 1
        assert -(-n // (k + 1)) <= r["spec_verify_ct"] <= n
    assert all(r["spec_verify_ct"] is None for r in plain)


CHUNKED = dict(chunked_prefill_size=8, max_prefill_tokens=8, page_size=4)


@pytest.fixture(scope="module")
def engines(ckpt):
    """(plain, speculative with k = 2) engines over chunked prefill, pages of 4 tokens and the prefix cache."""
    return (InProcessEngine(model_path=ckpt, dtype="float32", **CHUNKED),
            spec_engine(2, model_path=ckpt, dtype="float32", **CHUNKED))


def test_chunked_prefill_and_prefix_hits(engines):
    plain, spec = engines
    start = _free_pages(spec)
    prefix = _prompts(7, [24])[0]
    for seed, lengths in ((2, [3, 11]), (3, [5, 8, 1])):  # the second batch hits the first one's prefix
        prompts = _prompts(seed, lengths, prefix)
        want = plain.run(prompts, GREEDY)
        got = spec.run(prompts, GREEDY)
        assert [r["output_ids"] for r in got] == [r["output_ids"] for r in want]
    assert all(r["cached_tokens"] >= 24 for r in got)
    assert _free_pages(spec) == start


def test_stops_and_max_tokens_inside_a_run(engines):
    """A stop token or max_new_tokens landing inside an accepted run ends the output exactly where the plain run
    ends it; the KV past the stop is freed."""
    plain, spec = engines
    start = _free_pages(spec)
    prompts = _prompts(11, [6, 14, 9, 21, 4, 12])
    ref = plain.run(prompts, GREEDY)
    params = []
    for i, r in enumerate(ref):
        if i % 2:
            params.append(SamplingParams(max_new_tokens=5 + 3 * i, temperature=0.0, ignore_eos=True))
        else:  # the first occurrence of the token at index 3 + i stops it
            params.append(SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True,
                                         stop_token_ids=[r["output_ids"][3 + i]]))
    want = plain.run(prompts, params)
    got = spec.run(prompts, params)
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in want]
    assert [(r["finish_reason"].type, r["finish_reason"].matched) for r in got] == [
        (r["finish_reason"].type, r["finish_reason"].matched) for r in want]
    assert _free_pages(spec) == start


def test_logprobs_of_accepted_tokens(engines):
    plain, spec = engines
    prompts = _prompts(13, [7, 19])
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    want = plain.run(prompts, params, return_logprob=True, top_logprobs_num=3)
    got = spec.run(prompts, params, return_logprob=True, top_logprobs_num=3)
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"]
        assert len(g["logprobs"]) == len(g["output_ids"]) == len(g["top_logprobs"])
        torch.testing.assert_close(torch.tensor(g["logprobs"]), torch.tensor(w["logprobs"]), atol=1e-4, rtol=0)
        assert [[t for t, _ in top] for top in g["top_logprobs"]] == [[t for t, _ in top] for top in w["top_logprobs"]]


def test_abort_mid_run_frees_every_page(engines):
    _, spec = engines
    s = spec.scheduler
    start = _free_pages(spec)
    prompts = _prompts(17, [9, 30, 5])
    for i, p in enumerate(prompts):
        s.add_request(GenerateReq(f"abort-{i}", p, SamplingParams(max_new_tokens=100, ignore_eos=True,
                                                                   temperature=0.0)))
    for _ in range(8):
        spec.steps.step()
    assert s.stats.spec_rounds > 0 and s.num_used_tokens > 0
    for i in range(len(prompts)):
        s.abort(f"abort-{i}")
    assert all(o.finish_reason.type == "abort" for o in s.drain_pending()[-3:])
    assert not s.has_work() and s.num_used_tokens == 0
    assert _free_pages(spec) == start


def test_retraction_keeps_greedy_output(ckpt):
    """A pool so small that verify steps retract requests: recomputed, the same tokens."""
    prompts = _prompts(4, [30, 25, 31, 28, 20, 26])
    small = dict(max_total_tokens=200, page_size=2, new_token_ratio=0.0, dtype="float32")
    want = InProcessEngine(model_path=ckpt, **small).run(prompts, GREEDY)
    eng = spec_engine(3, model_path=ckpt, **small)
    got = eng.run(prompts, GREEDY)
    assert eng.scheduler.stats.retractions > 0
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in want]
    assert eng.scheduler.num_used_tokens == 0


def test_sampling_runs_and_seeded_requests_repeat(engines):
    """Temperature sampling through the round (its distribution is acceptance.py's test): seeded requests give
    the same tokens twice, whatever else is in the batch."""
    _, spec = engines
    prompts = _prompts(19, [8, 15, 3])
    params = [SamplingParams(max_new_tokens=16, temperature=0.8, top_k=20, seed=100 + i, ignore_eos=True)
              for i in range(3)]
    a = spec.run(prompts, params)
    b = spec.run(prompts[:1], params[:1])
    assert all(len(r["output_ids"]) == 16 and r["finish_reason"].type == "length" for r in a)
    assert b[0]["output_ids"] == a[0]["output_ids"]


def test_penalties_are_refused(engines):
    _, spec = engines
    res = spec.run([[5, 6, 7]], SamplingParams(max_new_tokens=4, frequency_penalty=0.5))
    assert res[0]["finish_reason"].type == "abort"
    assert "not supported with --speculative-algorithm" in res[0]["finish_reason"].message


def test_metrics_count_drafts_and_accept_length():
    from moeserve.rank.io_struct import LoadOut
    from moeserve.server.http.metrics import Metrics

    m = Metrics("m")

    def load(dp, spec):
        return LoadOut(dp_rank=dp, num_running=0, num_waiting=0, num_waiting_tokens=0, kv_used_tokens=0,
                       kv_total_tokens=1, num_cached_tokens=0, spec=spec)

    m.update_load([load(0, (10, 30, 12)), load(1, (6, 18, 2))])  # rounds, drafted, accepted per group
    text = m.render([load(0, (14, 42, 20)), load(1, (6, 18, 2))]).decode()
    assert 'moeserve:spec_draft_tokens_total{model_name="m"} 60.0' in text
    assert 'moeserve:spec_accepted_tokens_total{model_name="m"} 22.0' in text
    assert 'moeserve:spec_verify_steps_total{model_name="m"} 20.0' in text
    assert 'moeserve:spec_accept_length{model_name="m"} 3.0' in text  # (8 accepted + 4 rounds) / 4 rounds


def test_bench_serving_reports_the_accept_length():
    from moeserve.bench.serving import RequestResult, format_report, summarize

    results = [RequestResult(success=True, prompt_len=4, output_len=n, ttft=0.1, latency=1.0, expected_output_len=n,
                             spec_verify_ct=ct) for n, ct in ((10, 4), (20, 6))]
    summary = summarize(results, 2.0)
    assert summary["accept_length"] == 30 / 10
    assert "Accept length:" in format_report(summary, "moeserve", float("inf"), None)
    plain = summarize([RequestResult(success=True, output_len=5, ttft=0.1, latency=1.0)], 1.0)
    assert plain["accept_length"] is None
    assert "Accept length" not in format_report(plain, "moeserve", float("inf"), None)


@pytest.mark.parametrize("flags, named", [
    (dict(enable_mixed_chunk=True), "--enable-mixed-chunk"),
    (dict(expert_distribution_recorder_mode="stat"), "--enable-eplb and --expert-distribution-recorder-mode"),
    (dict(enable_torch_compile=True), "--enable-torch-compile"),
])
def test_unsupported_flags_are_refused_by_name(ckpt, flags, named):
    from moeserve.args import ServerArgs
    from moeserve.rank.speculative.support import unsupported_with_speculation

    assert unsupported_with_speculation(ServerArgs.from_kwargs(model_path=ckpt)) is None
    message = unsupported_with_speculation(ServerArgs.from_kwargs(model_path=ckpt, **flags))
    assert message == f"--speculative-algorithm with {named} is not supported yet"


def test_default_model_greedy_identical_and_stop_strings():
    """The shipped default model (trained: the stand-in drafter's drafts are often right there, so stops land
    inside accepted runs): the same tokens, and a stop string ends the output where the plain run ends it."""
    from moeserve.models.default_model import default_model_path
    from moeserve.text.tokenizer import load_tokenizer

    path = default_model_path()
    tok = load_tokenizer(path)
    rng = random.Random(23)
    prompts = [[rng.randrange(3, 3000) for _ in range(n)] for n in (12, 40, 7)]
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    plain = InProcessEngine(tokenizer=tok, model_path=path, dtype="float32")
    eng = spec_engine(3, tokenizer=tok, model_path=path, dtype="float32")
    want = plain.run(prompts, params)
    got = eng.run(prompts, params)
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in want]
    st = eng.scheduler.stats
    print(f"default model: accepted {st.spec_accepted} of {st.spec_drafted}")
    assert st.spec_accepted > 0
    # a stop string: the text of output tokens 5..6 of each request
    stops = [SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True,
                            stop=tok.decode(r["output_ids"][5:7], skip_special_tokens=False)) for r in want]
    want = plain.run(prompts, stops)
    got = eng.run(prompts, stops)
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in want]
    assert all(r["finish_reason"].type == "stop" and len(r["output_ids"]) <= 7 for r in got)


def _sampled_counts(eng: InProcessEngine, prompt: list[int], seeds: range) -> dict[tuple[int, ...], int]:
    params = [SamplingParams(max_new_tokens=3, temperature=1.0, top_k=3, seed=s, ignore_eos=True) for s in seeds]
    counts: dict[tuple[int, ...], int] = {}
    for r in eng.run([prompt] * len(seeds), params):
        key = tuple(r["output_ids"])
        counts[key] = counts.get(key, 0) + 1
    return counts


def _two_sample_chi_square(a: dict, b: dict) -> tuple[float, int]:
    cells = set(a) | set(b)
    stat = sum((a.get(c, 0) - b.get(c, 0)) ** 2 / (a.get(c, 0) + b.get(c, 0)) for c in cells)
    return stat, len(cells) - 1


def test_sampled_tokens_follow_the_plain_runs_distribution(ckpt, monkeypatch):
    """Through the engine: the joint law of three sampled tokens (top-k 3) with speculation equals the plain run's
    (a two-sample chi-square over 600 seeded requests each); keeping every draft fails the same check."""
    import math

    import moeserve.rank.speculative.round as round_module
    from moeserve.rank.speculative.acceptance import Accepted

    prompt = _prompts(29, [6])[0]
    n = 600
    plain = _sampled_counts(InProcessEngine(model_path=ckpt, dtype="float32"), prompt, range(10_000, 10_000 + n))
    spec_eng = spec_engine(2, model_path=ckpt, dtype="float32")
    spec = _sampled_counts(spec_eng, prompt, range(n))
    assert spec_eng.scheduler.stats.spec_accepted > 0

    def quantile(df: int, z: float = 4.265) -> float:  # 1 - 1e-5, Wilson-Hilferty
        return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3

    stat, df = _two_sample_chi_square(plain, spec)
    print(f"speculative vs plain: chi-square {stat:.1f} over {df} degrees of freedom (bound {quantile(df):.1f})")
    assert stat < quantile(df), (stat, df, plain, spec)

    def keep_every_draft(drafts, target_probs, draft_probs, seeds, steps):
        import torch

        bonus = torch.multinomial(target_probs[:, -1], 1).squeeze(1)
        return Accepted(tokens=torch.cat([drafts, bonus[:, None]], dim=1),
                        num_accepted=torch.full((drafts.shape[0],), drafts.shape[1], dtype=torch.int64))

    monkeypatch.setattr(round_module, "accept_sampled", keep_every_draft)
    wrong = _sampled_counts(spec_engine(2, model_path=ckpt, dtype="float32"), prompt, range(n))
    stat, df = _two_sample_chi_square(plain, wrong)
    print(f"keeping every draft vs plain: chi-square {stat:.1f} over {df} (bound {quantile(df):.1f})")
    assert stat > quantile(df), (stat, df)
