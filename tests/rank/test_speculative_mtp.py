"""Speculative decoding with DeepSeek's MTP layer (--speculative-algorithm NEXTN) through the real scheduler and
model runner: greedy tokens identical with speculation on and off on random tiny DeepSeek-V3 checkpoints carrying
an MTP layer in the published layout (float32; FP8 token by token against the target's prefill or decode step, see its test), with chunked prefill, pages of 4 tokens and prefix hits; the
KV pool's pages all come back. (A random MTP layer drafts badly: the tokens must not depend on it.)"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from moeserve.rank.sampling_params import SamplingParams
from tests.checkpoints import VOCAB
from tests.models.harness import Runner
from tests.rank.inprocess import InProcessEngine

GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


def _prompts(seed: int, lengths: list[int], prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(2, VOCAB) for _ in range(n)] for n in lengths]


def _same_with_and_without(path: str, steps: int, batches: list[list[list[int]]], **kwargs) -> InProcessEngine:
    kwargs.setdefault("max_total_tokens", 4096)  # two engines in one process: on a GPU the first must leave room
    plain = InProcessEngine(model_path=path, **kwargs)
    spec = InProcessEngine(model_path=path, speculative_algorithm="NEXTN", speculative_num_steps=steps, **kwargs)
    assert spec.runner.num_draft_tokens == steps and spec.scheduler.decode_len == steps + 1
    start = spec.scheduler.allocator.num_free_pages
    for prompts in batches:
        want = plain.run(prompts, GREEDY)
        got = spec.run(prompts, GREEDY)
        assert [r["output_ids"] for r in got] == [r["output_ids"] for r in want]
        assert all(r["spec_verify_ct"] > 0 for r in got)
    st = spec.scheduler.stats
    print(f"accepted {st.spec_accepted} of {st.spec_drafted} drafts in {st.spec_rounds} rounds")
    assert st.spec_rounds > 0
    spec.scheduler.cache.reset()
    assert spec.scheduler.allocator.num_free_pages == start
    return spec


@pytest.mark.parametrize("steps", [1, 3])
def test_mtp_greedy_identical(mtp_checkpoint, steps):
    _same_with_and_without(mtp_checkpoint, steps, [_prompts(1, [5, 17, 33, 9, 2])], dtype="float32")


def test_mtp_chunked_prefill_and_prefix_hits(mtp_checkpoint):
    prefix = _prompts(7, [24])[0]
    spec = _same_with_and_without(mtp_checkpoint, 2, [_prompts(2, [3, 11], prefix), _prompts(3, [5, 8], prefix)],
                                  dtype="float32", chunked_prefill_size=8, max_prefill_tokens=8, page_size=4)
    assert spec.scheduler.stats.prefilled > 0


def test_the_cache_keeps_only_draft_kv_the_target_wrote(mtp_checkpoint):
    """A finished request's cached positions carry the draft KV its target hidden states wrote: equal to what a
    fresh engine writes drafting over the same sequence as a prompt. The draft steps' scratch past the last verify
    (req.draft_start) is not cached, where a later prefix hit would draft from it."""
    kw = dict(model_path=mtp_checkpoint, dtype="float32", max_total_tokens=4096, page_size=1,
              speculative_algorithm="NEXTN", speculative_num_steps=3)
    prompt = _prompts(11, [20])[0]
    first = InProcessEngine(**kw)
    seq = prompt + first.run([prompt], GREEDY)[0]["output_ids"]  # its KV covers seq[:-1]
    cached = first.scheduler.cache.match_prefix(seq).slots
    assert len(prompt) <= len(cached) < len(seq) - 1  # the last verify's run is not cached
    fresh = InProcessEngine(**kw)
    fresh.run([seq + [5]], SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))
    again = fresh.scheduler.cache.match_prefix(seq).slots
    assert len(again) >= len(cached)
    for a, b in zip(first.runner.draft_kv_pool.buffers, fresh.runner.draft_kv_pool.buffers, strict=True):
        torch.testing.assert_close(a[torch.from_numpy(cached)], b[torch.from_numpy(again[:len(cached)])],
                                   atol=1e-4, rtol=1e-4)
    first.close()
    fresh.close()


FP8_TIE = 0.05  # log-prob: how far FP8 extends of the same tokens differ with the batch around them (below)


def test_mtp_fp8_greedy_follows_the_target(fp8_mtp_checkpoint):
    """FP8: on this near-uniform checkpoint (init std 0.02: top-2 gaps of 0.01) the FP8 extend and decode paths
    disagree by more than near-ties already without speculation (up to ~0.2 in a token's log-prob), and an
    extend's logits move by ~0.01 with the batch around it. So each token of the speculative run is checked on
    its own, along the path that chose it: the first (the prefill's) against a fresh prefill, each later one
    (a verify step's decode rows, rank/speculative/verify_rows.py) against a decode step of the token before
    it after a fresh prefill of the rest: the target's argmax, or within FP8_TIE of it."""
    fp8, _ = fp8_mtp_checkpoint
    prompts = _prompts(4, [6, 19, 11])
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    spec = InProcessEngine(model_path=fp8, speculative_algorithm="NEXTN", speculative_num_steps=2)
    start = spec.scheduler.allocator.num_free_pages
    got = spec.run(prompts, params)
    ref = Runner(fp8)
    for n, (p, r) in enumerate(zip(prompts, got, strict=True)):
        out = r["output_ids"]
        assert len(out) == params.max_new_tokens
        for i, token in enumerate(out):
            rid = (n, i)
            if i == 0:
                logits = ref.extend([(rid, p)])[-1]
            else:
                ref.extend([(rid, p + out[:i - 1])])
                logits = ref.decode([(rid, out[i - 1])])[0]
            logp = torch.log_softmax(logits.float(), dim=-1)
            assert logp.max() - logp[token] < FP8_TIE, (i, token, logp.topk(4))
    assert spec.scheduler.stats.spec_rounds > 0
    spec.scheduler.cache.reset()
    assert spec.scheduler.allocator.num_free_pages == start


def test_engine_with_the_flags(mtp_checkpoint):
    """The offline Engine (rank process, ZeroMQ) with --speculative-algorithm: the plain run's tokens, streaming
    in chunks of several tokens, spec_verify_ct in meta_info."""
    import moeserve

    prompts = _prompts(9, [4, 13])
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    want = [r["output_ids"] for r in InProcessEngine(model_path=mtp_checkpoint, dtype="float32").run(
        prompts, SamplingParams(**params))]
    eng = moeserve.Engine(model_path=mtp_checkpoint, skip_tokenizer_init=True, dtype="float32",
                          speculative_algorithm="EAGLE", speculative_num_steps=2)
    try:
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in outs] == want
        assert all(1 <= o["meta_info"]["spec_verify_ct"] <= 11 for o in outs)
        chunks = list(eng.generate(input_ids=prompts[0], sampling_params=params, stream=True))
        assert [t for c in chunks for t in c["delta_ids"]] == want[0]
        assert chunks[-1]["meta_info"]["spec_verify_ct"] >= 1
    finally:
        eng.shutdown()


def test_bench_one_batch_reports_the_accept_length(mtp_checkpoint, capsys):
    from moeserve.bench.one_batch import main

    assert main(["--model-path", mtp_checkpoint, "--batch-size", "2", "--input-len", "6", "--output-len", "9",
                 "--dtype", "float32", "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("batch")]
    assert len(lines) == 1 and "accept length" in lines[0]
    length = float(lines[0].rsplit("accept length", 1)[1])
    assert 1.0 <= length <= 3.0


@pytest.mark.parametrize("moe", [dict(), dict(moe_a2a_backend="all2all", deepep_mode="auto")],
                         ids=["tp_moe", "ep_all2all"])
def test_attention_tp_group_of_two_ranks(mtp_checkpoint, moe):
    """--tp-size 2 (one attention-TP group of two CPU ranks; experts TP-split, or over the two ranks with all2all):
    the single-rank plain run's greedy tokens; seeded sampling runs to its length (the ranks keep the leader's
    tokens, so their schedulers never part)."""
    import moeserve

    prompts = _prompts(3, [5, 14, 9])
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    want = [r["output_ids"] for r in InProcessEngine(model_path=mtp_checkpoint, dtype="float32").run(
        prompts, SamplingParams(**params))]
    eng = moeserve.Engine(model_path=mtp_checkpoint, skip_tokenizer_init=True, dtype="float32", tp_size=2,
                          speculative_algorithm="NEXTN", speculative_num_steps=2, **moe)
    try:
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in outs] == want
        sampled = eng.generate(input_ids=prompts, sampling_params={**params, "temperature": 0.9, "seed": 5})
        assert all(len(o["output_ids"]) == 12 for o in sampled)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("moe", [dict(), dict(moe_a2a_backend="all2all", deepep_mode="normal"),
                                 dict(moe_a2a_backend="all2all", deepep_mode="low_latency"),
                                 dict(moe_a2a_backend="all2all", deepep_mode="auto"),
                                 dict(moe_a2a_backend="all2all", deepep_mode="auto", enable_two_batch_overlap=True,
                                      tbo_token_threshold=1)],
                         ids=["allgather", "all2all_normal", "all2all_low_latency", "all2all_auto", "tbo"])
def test_dp_attention_with_ep(mtp_checkpoint, moe):
    """Two DP groups of one CPU rank each, experts over both: each group drafts and verifies its own requests; a
    group that does not draft in a step (it prefills, or has nothing) joins the draft forwards' collectives. The
    single-rank plain run's greedy tokens; also with two-batch overlap (the target's steps, verify included, split
    in two micro-batches; the draft forwards are not)."""
    import moeserve

    prompts = _prompts(8, [5, 14, 9, 21, 3])
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    want = [r["output_ids"] for r in InProcessEngine(model_path=mtp_checkpoint, dtype="float32").run(
        prompts, SamplingParams(**params))]
    eng = moeserve.Engine(model_path=mtp_checkpoint, skip_tokenizer_init=True, dtype="float32", tp_size=2,
                          dp_size=2, enable_dp_attention=True, speculative_algorithm="NEXTN",
                          speculative_num_steps=2, **moe)
    try:
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in outs] == want
        assert all(o["meta_info"]["spec_verify_ct"] >= 1 for o in outs)
        loads = eng.get_load()
        rounds = {load.dp_rank: load.spec[0] for load in loads}
        assert rounds.keys() == {0, 1} and all(rounds.values()), rounds  # both groups verified
        if moe.get("enable_two_batch_overlap"):  # some steps ran as two overlapped micro-batches
            assert any(n for load in loads for kind, n in load.step_counts.items() if kind.startswith("tbo ")), loads
    finally:
        eng.shutdown()


def test_default_model_with_its_trained_mtp_layer():
    """The shipped default model and its trained MTP layer on held-out text: the plain run's greedy tokens, and
    drafts that are often right (the accept length the training recorded at k = 2 is 2.28 on other windows)."""
    from moeserve.models.default_model import default_model_path
    from moeserve.text.tokenizer import load_tokenizer

    path = default_model_path()
    tok = load_tokenizer(path)
    text = (Path(path) / "heldout.txt").read_text(encoding="utf-8")
    ids = tok.encode(text)
    prompts = [ids[i:i + 48] for i in (0, 400, 900, 1500)]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    want = InProcessEngine(model_path=path, dtype="float32", max_total_tokens=4096).run(prompts, params)
    spec = InProcessEngine(model_path=path, dtype="float32", max_total_tokens=4096,
                           speculative_algorithm="NEXTN", speculative_num_steps=2)
    got = spec.run(prompts, params)
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in want]
    st = spec.scheduler.stats
    accept_length = (st.spec_accepted + st.spec_rounds) / st.spec_rounds
    print(f"default model, k=2: accept length {accept_length:.2f}")
    assert accept_length > 1.5
