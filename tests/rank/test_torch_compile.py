"""--enable-torch-compile: compiled decode equals eager decode, and one compiled graph serves every batch size."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from moeserve.args import ServerArgs
from moeserve.rank.sampling_params import SamplingParams
from tests.checkpoints import build_checkpoint
from tests.rank.inprocess import InProcessEngine
from tests.rank.test_generation import MIXED, _prompts


@pytest.mark.parametrize("name", ["v3_groups", "qwen3_moe"])  # MLA and GQA attention
def test_compiled_decode_equals_eager(tmp_path, name):
    path = build_checkpoint(name, tmp_path / name)
    prompts = _prompts(5, MIXED + [40, 3])
    # Different lengths: the batch shrinks from 8 requests to 1 as they finish (the last steps run padded to 2).
    params = [SamplingParams(max_new_tokens=6 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    eager = InProcessEngine(model_path=path, max_total_tokens=4096).run(prompts, params)
    graphs_before = counters["stats"]["unique_graphs"]
    engine = InProcessEngine(model_path=path, max_total_tokens=4096, enable_torch_compile=True)
    compiled_at_start = counters["stats"]["unique_graphs"] - graphs_before
    out = engine.run(prompts, params)
    assert [r["output_ids"] for r in out] == [r["output_ids"] for r in eager]
    graphs = engine.runner.graph_runner
    if graphs is not None:  # on CUDA the graph runner captures the compiled forward, padded batches included
        assert graphs.graphs and all(g is not None for g in graphs.graphs.values())
    assert compiled_at_start == 1
    assert counters["stats"]["unique_graphs"] - graphs_before == 1, "a decode batch recompiled the forward"


def test_compile_flags():
    assert ServerArgs(enable_torch_compile=True).torch_compile_max_bs == 32
    with pytest.raises(ValueError, match="one rank"):
        ServerArgs(enable_torch_compile=True, tp_size=2)
    with pytest.raises(ValueError, match="torch-compile-max-bs"):
        ServerArgs(torch_compile_max_bs=0)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
