"""CUDA-graph decode equals eager decode (GPU only; skipped on CPU)."""

from __future__ import annotations

import pytest
import torch

from moeserve.rank.sampling_params import SamplingParams
from tests.checkpoints import build_checkpoint
from tests.rank.inprocess import InProcessEngine
from tests.rank.test_generation import MIXED, _prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("tbo", [False, True], ids=["plain", "tbo"])  # TBO: every captured step overlaps its halves
@pytest.mark.parametrize("name", ["v3_groups", "qwen3_moe"])
def test_graph_decode_equals_eager(tmp_path, name, tbo):
    path = build_checkpoint(name, tmp_path / name)
    prompts = _prompts(3, MIXED + [40, 3, 7])
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    eager = InProcessEngine(model_path=path, device="cuda", disable_cuda_graph=True,
                           max_total_tokens=4096).run(prompts, params)
    overlap = dict(enable_two_batch_overlap=True, tbo_token_threshold=1) if tbo else {}
    graph_engine = InProcessEngine(model_path=path, device="cuda", cuda_graph_max_bs=16, max_total_tokens=4096,
                                   **overlap)
    graphed = graph_engine.run(prompts, params)
    runner = graph_engine.runner.graph_runner
    assert runner is not None and runner.graphs and all(g is not None for g in runner.graphs.values())
    assert [r["output_ids"] for r in graphed] == [r["output_ids"] for r in eager]
