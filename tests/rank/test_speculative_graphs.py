"""Speculative decoding in CUDA graphs (GPU only; skipped on CPU): the verify step's decode rows and the draft's
decode rows (its extend over accepted tokens, its one-token steps) replayed from graphs give the tokens of the eager
round and of the plain run, with ragged batches (requests of different lengths and accept lengths) and a batch that
is not a captured bucket."""

from __future__ import annotations

import pytest
import torch

from moeserve.rank.sampling_params import SamplingParams
from tests.rank.inprocess import InProcessEngine
from tests.rank.test_speculative_mtp import GREEDY, _prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("steps", [1, 3])
def test_graphed_rounds_equal_eager_rounds(mtp_checkpoint, steps):
    common = dict(model_path=mtp_checkpoint, device="cuda", dtype="float32", max_total_tokens=4096,
                  speculative_algorithm="NEXTN", speculative_num_steps=steps)
    batches = [_prompts(1, [5, 17, 33, 9, 2]), _prompts(2, [40, 3, 11])]  # 5 and 3 requests: buckets 8 and 4
    plain = InProcessEngine(model_path=mtp_checkpoint, device="cuda", dtype="float32", max_total_tokens=4096)
    eager = InProcessEngine(disable_cuda_graph=True, **common)
    graphed = InProcessEngine(cuda_graph_max_bs=8, **common)
    runner = graphed.runner
    assert runner.graph_runner is not None and runner.graph_runner.with_hidden
    assert runner.speculative.draft_graphs is not None
    for prompts in batches:
        want = plain.run(prompts, GREEDY)
        got_eager = eager.run(prompts, GREEDY)
        got = graphed.run(prompts, GREEDY)
        assert [r["output_ids"] for r in got] == [r["output_ids"] for r in want]
        assert [r["output_ids"] for r in got_eager] == [r["output_ids"] for r in want]
        assert [r["spec_verify_ct"] for r in got] == [r["spec_verify_ct"] for r in got_eager]
    assert runner.graph_runner.num_steps > 0  # the verify steps replayed
    assert all(g is not None for g in runner.graph_runner.graphs.values())
    assert runner.speculative.draft_graphs.graphs.num_steps > 0  # the draft extends (and steps 2..k) replayed


def test_graphed_rounds_sampled(mtp_checkpoint):
    """Seeded sampling: the graphed rounds give the eager rounds' tokens (the same probabilities, the same seeds)."""
    common = dict(model_path=mtp_checkpoint, device="cuda", dtype="float32", max_total_tokens=4096,
                  speculative_algorithm="NEXTN", speculative_num_steps=2)
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    prompts = _prompts(4, [6, 13, 21])
    eager = InProcessEngine(disable_cuda_graph=True, **common).run(prompts, params)
    graphed = InProcessEngine(cuda_graph_max_bs=4, **common).run(prompts, params)
    assert [r["output_ids"] for r in graphed] == [r["output_ids"] for r in eager]
