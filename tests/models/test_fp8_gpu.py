"""FP8 on the GPU (skipped without CUDA): the Triton FP8 path equals the CPU's torch reference path, CUDA graphs
give the eager tokens, and a DeepSeek-V2-Lite-shaped dummy model quantized at load runs.

Run on the GPU machine:  python3 -m pytest -o addopts="" -s tests/models/test_fp8_gpu.py tests/kernels
"""

from __future__ import annotations

import pytest
import torch

from moeserve.args import ServerArgs
from moeserve.models.loader import load_model, weight_format
from tests.checkpoints import write_config_only
from tests.models.harness import Runner, random_tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_fp8_cuda_equals_cpu(fp8_checkpoint):
    path = fp8_checkpoint[0]
    cpu, gpu = Runner(path), Runner(path, device="cuda")
    prompts = [("a", random_tokens(9, 1)), ("b", random_tokens(3, 2)), ("c", random_tokens(14, 3))]
    got, want = gpu.extend(prompts), cpu.extend(prompts)
    # the same math; an fp32 difference that moves a value across an e4m3 rounding boundary shows as one e4m3 step
    assert float((got - want).norm() / want.norm()) < 2e-2
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95
    for step in range(4):
        reqs = [(r, t) for (r, _), t in zip(prompts, random_tokens(3, 10 + step), strict=True)]
        got, want = gpu.decode(reqs), cpu.decode(reqs)
        assert float((got - want).norm() / want.norm()) < 2e-2


def test_fp8_cuda_graphs_give_the_eager_tokens(fp8_checkpoint):
    from moeserve.rank.sampling_params import SamplingParams
    from tests.rank.inprocess import InProcessEngine

    prompts = [random_tokens(n, seed=n) for n in (5, 17, 9, 2)]
    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    graphs = InProcessEngine(model_path=fp8_checkpoint[0], dtype="bfloat16", device="cuda")
    assert graphs.runner.graph_runner is not None
    eager = InProcessEngine(model_path=fp8_checkpoint[0], dtype="bfloat16", device="cuda", disable_cuda_graph=True)
    assert [r["output_ids"] for r in graphs.run(prompts, sp)] == [r["output_ids"] for r in eager.run(prompts, sp)]


def test_v2_lite_dummy_quantized_at_load(tmp_path):
    path = write_config_only("DeepSeek-V2-Lite", tmp_path)
    model, config = load_model(ServerArgs(model_path=path, load_format="dummy", quantization="fp8"), "cuda")
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"\nV2-Lite dummy FP8: {nbytes / 2**30:.1f} GiB of weights ({weight_format(model)})")
    assert nbytes < 0.6 * 15.7e9 * 2  # about half of bf16's 29 GiB
    runner = Runner(path, device="cuda", dtype="bfloat16", load_format="dummy", quantization="fp8")
    assert torch.isfinite(runner.extend([("a", random_tokens(64, seed=0))])).all()
