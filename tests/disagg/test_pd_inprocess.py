"""PD disaggregation in one process (tests/disagg/pd_harness.py): greedy tokens equal the colocated engine's on
the tiny checkpoints of the four architectures and the embedded model, with chunked prefill (chunks of 8 tokens,
pages of 4: chunks end inside pages) and a prefix hit on the prefill side; both pools' free pages come back."""

from __future__ import annotations

import random

import pytest
import torch

from moeserve.rank.sampling_params import SamplingParams
from tests.disagg.pd_harness import PDPair, bootstrap_refusal
from tests.rank.inprocess import InProcessEngine

FLAGS = dict(page_size=4, chunked_prefill_size=8, max_total_tokens=2048)
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


def _prompts(seed: int, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """First-round prompts of several lengths, then second-round prompts that share a first-round prefix."""
    rng = random.Random(seed)
    first = [[rng.randrange(2, vocab) for _ in range(n)] for n in (5, 13, 22, 31)]
    second = [first[2][:17] + [rng.randrange(2, vocab) for _ in range(6)], list(first[3])]
    return first, second


def _mooncake_loads() -> bool:
    try:
        from moeserve.disagg.transfer.registry import backend_class

        backend_class("mooncake")
        return True
    except ValueError:
        return False


MOONCAKE = pytest.mark.skipif(not _mooncake_loads(), reason="Mooncake is not installed (make install)")


@pytest.mark.parametrize("name, backend", [
    ("v3_q_lora", "zmq"), ("v2_lite", "zmq"), ("qwen3_moe", "zmq"), ("mixtral", "zmq"), ("default", "zmq"),
    pytest.param("v3_q_lora", "mooncake", marks=MOONCAKE), pytest.param("qwen3_moe", "mooncake", marks=MOONCAKE),
])
def test_pd_tokens_equal_colocated(name, backend, tiny_checkpoint):
    from moeserve.models.default_model import default_model_path

    path = default_model_path() if name == "default" else tiny_checkpoint(name)
    ref = InProcessEngine(model_path=path, dtype="float32", **FLAGS)
    first, second = _prompts(hash(name) % 1000, min(ref.runner.vocab_size, 500))
    ref_first = ref.run(first, GREEDY, return_logprob=True)
    ref_second = ref.run(second, GREEDY, return_logprob=True)
    del ref

    pair = PDPair(model_path=path, disaggregation_transfer_backend=backend, **FLAGS)
    try:
        start = (pair.prefill.free_pages(), pair.decode.free_pages())
        got_first = pair.run(first, GREEDY, return_logprob=True)
        got_second = pair.run(second, GREEDY, return_logprob=True)
        for got, want in zip(got_first + got_second, ref_first + ref_second, strict=True):
            assert got["output_ids"] == want["output_ids"]
            assert got["finish_reason"].type == "length"
            torch.testing.assert_close(torch.tensor(got["logprobs"]), torch.tensor(want["logprobs"]),
                                       atol=1e-4, rtol=0)
        # the prefix cache works on the prefill side and decode reports it
        assert [g["cached_tokens"] for g in got_second] == [w["cached_tokens"] for w in ref_second]
        assert got_second[0]["cached_tokens"] == 16 and got_second[1]["cached_tokens"] == 28
        stats = pair.decode.scheduler.pd.stats
        assert stats.transfers == 6 and stats.transfer_bytes > 0
        # without logprobs the decode side overlaps its steps (rank/steps.py): the same tokens
        assert [g["output_ids"] for g in pair.run(first, GREEDY)] == [w["output_ids"] for w in ref_first]
        assert pair.decode.steps.num_overlapped > 0
        assert (pair.prefill.free_pages(), pair.decode.free_pages()) == start
    finally:
        pair.close()


@pytest.mark.parametrize("decode_kwargs, says", [
    (dict(page_size=8), "page_size is 4 on the prefill server and 8 here"),
    (dict(dtype="bfloat16"), "page_bytes"),
])
def test_mismatched_sides_refuse_at_bootstrap(decode_kwargs, says):
    """Sides that cannot share KV pages (another page size, another KV dtype) fail the request with a clear error
    at bootstrap, before any page is reserved; both sides serve on."""
    from moeserve.models.default_model import default_model_path

    pair = PDPair(model_path=default_model_path(), decode_kwargs=decode_kwargs, page_size=4, max_total_tokens=512)
    try:
        message = bootstrap_refusal(pair, GREEDY)
        assert "prefill and decode cannot pair" in message and says in message, message
    finally:
        pair.close()


def test_pd_prompt_logprobs_equal_colocated():
    """return_logprob with logprob_start_len (0, a middle position) and top alternatives: prefill scores the prompt
    (chunked, pages of 4) and answers input_token_logprobs; decode answers an empty list and no top alternatives;
    prefill's + decode's, as the router concatenates them, equal the colocated engine's. A request without
    logprobs gets none from prefill, as before."""
    from moeserve.models.default_model import default_model_path

    path = default_model_path()
    ref = InProcessEngine(model_path=path, dtype="float32", **FLAGS)
    rng = random.Random(17)
    prompts = [[rng.randrange(2, min(ref.runner.vocab_size, 500)) for _ in range(n)] for n in (11, 23)]
    starts = (0, 9)
    want = {s: ref.run(prompts, GREEDY, return_logprob=True, top_logprobs_num=3, logprob_start_len=s) for s in starts}
    del ref

    pair = PDPair(model_path=path, **FLAGS)
    try:
        for s in starts:
            got = pair.run(prompts, GREEDY, return_logprob=True, top_logprobs_num=3, logprob_start_len=s)
            for g, w, ids in zip(got, want[s], prompts, strict=True):
                assert g["output_ids"] == w["output_ids"]
                assert len(g["input_logprobs"]) == len(ids) - s == len(w["input_logprobs"])
                assert g["decode_inputs"].input_logprobs == [] and g["decode_inputs"].input_top_logprobs is None
                if s == 0:  # nothing predicts the first token
                    assert g["input_logprobs"][0] is None and w["input_logprobs"][0] is None
                k = 1 if s == 0 else 0
                torch.testing.assert_close(torch.tensor(g["input_logprobs"][k:]),
                                           torch.tensor(w["input_logprobs"][k:]), atol=1e-4, rtol=0)
                tops = g["prefill_inputs"].input_top_logprobs
                assert [[t for t, _ in alts] for alts in tops] == [[t for t, _ in alts] for alts in
                                                                    w["input_top_logprobs"]]
        pair.submit("plain", prompts[0], GREEDY)
        pair.step_until(lambda: pair.finished(pair.decode, "plain") and pair.finished(pair.prefill, "plain"))
        plain, first = pair.result("plain"), pair.prefill.outs["plain"]
        assert plain["input_logprobs"] is None and plain["prefill_inputs"] is None and plain["decode_inputs"] is None
        assert len(first) == 1 and first[0].logprobs is None and first[0].input_top_logprobs is None
        assert first[0].new_token_ids == plain["output_ids"][:1] and first[0].finish_reason.type == "length"
    finally:
        pair.close()
