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


def test_compiled_decode_over_packed_bf16_experts(tmp_path):
    """bf16 where the experts are held packed (the amx and avx512bf16 builds): the compiled decode calls the packed
    kernels through their custom ops, one graph for every batch, and its tokens' log-probs stay near eager's
    (Inductor rounds bf16 otherwise than eager, so the tokens themselves may part)."""
    from moeserve.kernels import cpu_experts

    if not cpu_experts.packed_runs():
        pytest.skip("the packed experts kernels do not run on this CPU")
    path = build_checkpoint("v3_groups", tmp_path / "v3")
    prompts = _prompts(5, MIXED)
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    eager = InProcessEngine(model_path=path, max_total_tokens=4096, dtype="bfloat16")
    graphs_before = counters["stats"]["unique_graphs"]
    engine = InProcessEngine(model_path=path, max_total_tokens=4096, dtype="bfloat16", enable_torch_compile=True)
    assert all(m.experts.packed for m in engine.runner.model.moe_layers())
    out = engine.run(prompts, params, return_logprob=True)  # batches of 8 down to 1
    # one graph: the CPU kernels' takes() ask for torch.compile before comparing a size, which would guard the graph
    assert counters["stats"]["unique_graphs"] - graphs_before == 1, "a decode batch recompiled the forward"
    assert all(len(r["output_ids"]) == 4 for r in out)
    for r in out:  # each token compiled chose, scored by eager over the same tokens: near the compiled log-prob
        ids = r["output_ids"]
        prompt = prompts[out.index(r)]
        ref = eager.run([prompt + ids[:-1]], SamplingParams(max_new_tokens=1, temperature=0), return_logprob=True,
                        logprob_start_len=len(prompt) - 1)[0]
        assert ref["input_logprobs"][1:] == pytest.approx(r["logprobs"][:-1], abs=0.15)


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
