"""Speculative decoding (--speculative-algorithm NEXTN) under PD disaggregation, in one process
(tests/disagg/pd_harness.py): the prefill server drafts over each prompt, its draft KV travels after the target's
and its `done` carries h_{L-1}; the decode server drafts and verifies from there. Against the single server:
greedy tokens equal the plain and the speculative single server's, and each request's verify rounds
(spec_verify_ct: the accept length) equal the speculative single server's, on a random tiny DeepSeek-V3 checkpoint
with an MTP layer and on the trained default model, with chunked prefill (chunks of 8, pages of 4) and prefix hits
on the prefill side; seeded sampling and an FP8 checkpoint give the speculative single server's tokens; the
hidden state's JSON form keeps its bits; aborts in every state, from
either side, and decode's retractions leak no page; a side without speculation refuses to pair. (Decode keeps no
prefix cache in PD: a prompt's prefix is hit on the prefill side, whose cached draft KV travels too.)"""

from __future__ import annotations

import json
import random

import pytest
import torch

from moeserve.disagg.messages import BadMessage, pack_tensor, unpack_tensor
from moeserve.rank.sampling_params import SamplingParams
from tests.checkpoints import VOCAB
from tests.disagg.pd_harness import ABORTS, PDPair, abort_in_every_state, bootstrap_refusal
from tests.rank.inprocess import InProcessEngine

FLAGS = dict(page_size=4, chunked_prefill_size=8, max_total_tokens=2048, dtype="float32")
SPEC = dict(speculative_algorithm="NEXTN", speculative_num_steps=2)
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def _path(name: str, mtp_checkpoint: str) -> str:
    from moeserve.models.default_model import default_model_path

    return default_model_path() if name == "default" else mtp_checkpoint


def _prompts(seed: int, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """First-round prompts of several lengths, then second-round prompts that share a first-round prefix."""
    rng = random.Random(seed)
    first = [[rng.randrange(2, vocab) for _ in range(n)] for n in (5, 13, 22, 31)]
    second = [first[2][:17] + [rng.randrange(2, vocab) for _ in range(6)], list(first[3])]
    return first, second


def _run_each(pair: PDPair, prompts: list[list[int]], params: list[SamplingParams]) -> list[dict]:
    rids = [f"s{i}" for i in range(len(prompts))]
    for rid, ids, p in zip(rids, prompts, params, strict=True):
        pair.submit(rid, ids, p)
    pair.step_until(lambda: all(pair.finished(pair.decode, r) and pair.finished(pair.prefill, r) for r in rids))
    return [pair.result(r) for r in rids]


@pytest.mark.parametrize("name", ["mtp", "default"])
def test_pd_nextn_equals_the_single_server(name, mtp_checkpoint):
    path = _path(name, mtp_checkpoint)
    first, second = _prompts(11, VOCAB if name == "mtp" else 500)
    plain = InProcessEngine(model_path=path, **FLAGS)
    want = plain.run(first, GREEDY) + plain.run(second, GREEDY)
    del plain
    single = InProcessEngine(model_path=path, **FLAGS, **SPEC)
    ref = single.run(first, GREEDY) + single.run(second, GREEDY)
    del single
    assert [r["output_ids"] for r in ref] == [w["output_ids"] for w in want]

    pair = PDPair(model_path=path, **FLAGS, **SPEC)
    try:
        start = (pair.prefill.free_pages(), pair.decode.free_pages())
        got = pair.run(first, GREEDY) + pair.run(second, GREEDY)
        assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
        assert all(g["finish_reason"].type == "length" for g in got)
        # the draft saw the same KV and hidden states: the same drafts accepted, round for round
        assert [g["spec_verify_ct"] for g in got] == [r["spec_verify_ct"] for r in ref]
        assert all(0 < g["spec_verify_ct"] <= GREEDY.max_new_tokens - 1 for g in got)
        # the prefix cache works on the prefill side (its draft KV included) and decode reports it
        assert [g["cached_tokens"] for g in got] == [r["cached_tokens"] for r in ref]
        assert got[4]["cached_tokens"] == 16 and got[5]["cached_tokens"] == 28
        st = pair.decode.scheduler.stats
        print(f"{name}: accepted {st.spec_accepted} of {st.spec_drafted} drafts in {st.spec_rounds} rounds")
        assert st.spec_rounds == sum(g["spec_verify_ct"] for g in got)
        if name == "default":  # a trained MTP layer drafts well: the transferred draft state is used
            assert st.spec_accepted > st.spec_rounds // 2
        pair.step_until(pair.idle)
        assert (pair.prefill.free_pages(), pair.decode.free_pages()) == start
    finally:
        pair.close()


def test_pd_nextn_seeded_sampling_equals_the_single_server():
    """Temperature 0.8, top-p 0.9, a seed per request: the speculative single server's tokens, token for token
    (prefill samples the first token as the single server's prefill does; decode's rounds follow)."""
    from moeserve.models.default_model import default_model_path

    path = default_model_path()
    first, second = _prompts(5, 500)
    prompts = first + second
    params = [SamplingParams(max_new_tokens=14, temperature=0.8, top_p=0.9, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    ref = InProcessEngine(model_path=path, **FLAGS, **SPEC).run(prompts, params)
    pair = PDPair(model_path=path, **FLAGS, **SPEC)
    try:
        got = _run_each(pair, prompts, params)
        assert [g["output_ids"] for g in got] == [r["output_ids"] for r in ref]
        assert [g["spec_verify_ct"] for g in got] == [r["spec_verify_ct"] for r in ref]
        assert len({tuple(r["output_ids"]) for r in ref}) == len(ref)
    finally:
        pair.close()


def test_pd_nextn_aborts_and_retractions_leak_no_page(mtp_checkpoint):
    """Aborts in every state from either side (mid-transfer included; a small decode pool: some wait for space):
    the survivors' greedy tokens equal the plain single server's, both pools' free pages come back."""
    rng = random.Random(3)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(6, 40))] for _ in range(14)]
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    flags = dict(page_size=4, chunked_prefill_size=8, dtype="float32")
    ref = InProcessEngine(model_path=mtp_checkpoint, **flags).run(prompts, params)
    pair = PDPair(model_path=mtp_checkpoint, decode_kwargs=dict(max_total_tokens=160), max_total_tokens=1024,
                  **flags, **SPEC)
    try:
        start = (pair.prefill.free_pages(), pair.decode.free_pages())
        rids = [f"a{i}" for i in range(len(prompts))]
        for rid, ids in zip(rids, prompts, strict=True):
            pair.submit(rid, ids, params)
        plan = abort_in_every_state(pair, rids)
        pair.step_until(pair.idle)
        assert sorted(plan.values()) == sorted(ABORTS), plan
        for i, rid in enumerate(rids):
            got = pair.result(rid)
            if rid in plan:
                assert got["finish_reason"].type == "abort", (rid, plan[rid], got)
            else:
                assert got["output_ids"] == ref[i]["output_ids"], rid
                assert got["spec_verify_ct"] > 0
        assert (pair.prefill.free_pages(), pair.decode.free_pages()) == start
    finally:
        pair.close()


def test_pd_nextn_decode_retraction(mtp_checkpoint):
    """A decode pool too small for every request's output (no room kept back for it): decode retracts, recomputes
    the retracted requests itself (their draft state from that prefill, round.after_extend) and gives the plain
    single server's tokens; every page comes back."""
    rng = random.Random(8)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(25, 32))] for _ in range(6)]
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    flags = dict(page_size=4, chunked_prefill_size=8, dtype="float32")
    ref = InProcessEngine(model_path=mtp_checkpoint, **flags).run(prompts, params)
    pair = PDPair(model_path=mtp_checkpoint, decode_kwargs=dict(max_total_tokens=160, new_token_ratio=0.0),
                  max_total_tokens=1024, **flags, **SPEC)
    try:
        start = (pair.prefill.free_pages(), pair.decode.free_pages())
        got = pair.run(prompts, params)
        assert pair.decode.scheduler.stats.retractions > 0
        assert [g["output_ids"] for g in got] == [r["output_ids"] for r in ref]
        pair.step_until(pair.idle)
        assert (pair.prefill.free_pages(), pair.decode.free_pages()) == start
    finally:
        pair.close()


def test_pd_nextn_fp8_equals_the_single_server(fp8_mtp_checkpoint):
    """An FP8 checkpoint: the draft KV pool is just more buffers (after the target's, in kv_buffers' order). One
    prompt at a time on both (an FP8 extend's logits move with the batch around it, test_speculative_mtp.py): the
    speculative single server's tokens and verify rounds."""
    from moeserve.kvcache.kv_pool import kv_buffers

    fp8, _ = fp8_mtp_checkpoint
    rng = random.Random(4)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(n)] for n in (6, 19, 11)]
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    flags = dict(page_size=4, chunked_prefill_size=8, max_total_tokens=2048, **SPEC)
    single = InProcessEngine(model_path=fp8, **flags)
    ref = [single.run([p], params)[0] for p in prompts]
    del single
    pair = PDPair(model_path=fp8, **flags)
    try:
        runner = pair.prefill.runner
        want = kv_buffers(runner.kv_pool) + kv_buffers(runner.speculative.drafter.kv_pool)
        got_buffers = pair.prefill.scheduler.pd.backend.buffers
        assert len(got_buffers) == len(want) and all(a is b for a, b in zip(got_buffers, want, strict=True))
        got = [pair.run([p], params)[0] for p in prompts]
        assert [g["output_ids"] for g in got] == [r["output_ids"] for r in ref]
        assert [g["spec_verify_ct"] for g in got] == [r["spec_verify_ct"] for r in ref]
    finally:
        pair.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_hidden_state_travels_as_json(dtype):
    """`done`'s h_{L-1}: the tensor's exact bits through JSON (bf16 has no numpy form); a mangled one is refused."""
    h = torch.randn(1, 48).to(dtype)
    packed = json.loads(json.dumps(pack_tensor(h)))
    back = unpack_tensor(packed)
    assert back.dtype == dtype and back.shape == h.shape and torch.equal(back, h)
    with pytest.raises(BadMessage, match="not a packed tensor"):
        unpack_tensor({**packed, "shape": [2, 48]})
    with pytest.raises(BadMessage, match="not a packed tensor"):
        unpack_tensor({**packed, "dtype": "Tensor"})


@pytest.mark.parametrize("spec_side", ["prefill", "decode"])
def test_speculation_on_one_side_refuses_to_pair(spec_side, mtp_checkpoint):
    """The draft KV and h_{L-1} come only from a speculating prefill server: sides that differ fail the request at
    bootstrap with a clear error, before any page is reserved."""
    kwargs = {f"{spec_side}_kwargs": SPEC}
    pair = PDPair(model_path=mtp_checkpoint, page_size=4, max_total_tokens=512, dtype="float32", **kwargs)
    try:
        message = bootstrap_refusal(pair, GREEDY)
        assert "speculative decoding is on one side only" in message, message
    finally:
        pair.close()


def test_pd_with_dp_attention_refused_by_name():
    from moeserve.args import ServerArgs
    from moeserve.rank.speculative.support import unsupported_with_speculation

    for mode in ("prefill", "decode"):
        assert unsupported_with_speculation(ServerArgs.from_kwargs(model_path="m", disaggregation_mode=mode)) is None
        message = unsupported_with_speculation(ServerArgs.from_kwargs(
            model_path="m", disaggregation_mode=mode, enable_dp_attention=True, tp_size=2, dp_size=2))
        assert message == ("--speculative-algorithm with --disaggregation-mode and --enable-dp-attention is not "
                           "supported yet")
