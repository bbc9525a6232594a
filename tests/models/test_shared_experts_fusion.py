"""--enable-shared-experts-fusion: the shared MLP runs as always-picked expert slots in the routed experts' kernels.

Same greedy tokens and logprobs as the unfused model on DeepSeek-V2 and V3 checkpoints (two shared experts in V2's
tiny config, one in V3's), through the CPU experts kernel and the grouped GEMM; the layers really hold the extra
slots and no shared MLP; the flag is refused where it would do nothing or cannot run.
"""

from __future__ import annotations

import pytest
import torch

from moeserve.args import ServerArgs
from moeserve.rank.sampling_params import SamplingParams
from tests.rank.inprocess import InProcessEngine
from tests.rank.test_generation import _prompts

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(("name", "backend"), [("v2_lite", "auto"), ("v3_groups", "auto"),
                                               ("v3_groups", "grouped_gemm")])
def test_fused_equals_unfused(tiny_checkpoint, name, backend):
    path = tiny_checkpoint(name)
    prompts = _prompts(5, [3, 17, 40, 9])
    runs = {}
    for fused in (False, True):
        eng = InProcessEngine(model_path=path, dtype="float32", device="cpu", moe_runner_backend=backend,
                              enable_shared_experts_fusion=fused)
        runs[fused] = eng.run(prompts, GREEDY, return_logprob=True)
        moes = eng.runner.model.moe_layers()
        n = eng.runner.config.num_shared_experts
        assert n > 0
        for m in moes:
            assert (m.shared_experts is None) == fused
            assert m.experts.w13.shape[0] == m.experts.num_local_experts + (n if fused else 0)
    assert [r["output_ids"] for r in runs[True]] == [r["output_ids"] for r in runs[False]]
    for a, b in zip(runs[True], runs[False], strict=True):
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4)


@pytest.mark.parametrize("name", ["v2_lite", "v3_groups"])
@pytest.mark.parametrize("apart_from", [1, 8])
def test_fused_slots_run_apart_at_prefill_sizes(tiny_checkpoint, name, apart_from):
    """From shared_apart_from tokens a step (SHARED_APART_TOKENS at prefill sizes) the fused slots run apart as a
    dense MLP on their own weights, not routed: the same tokens and logprobs as unfused, with steps of both kinds
    (apart_from 8: the prefills apart, the decodes of 4 routed) or all apart (1)."""
    from moeserve.layers.moe.layer import SHARED_APART_TOKENS

    path = tiny_checkpoint(name)
    prompts = _prompts(5, [3, 17, 40, 9])
    plain = InProcessEngine(model_path=path, dtype="float32", device="cpu").run(prompts, GREEDY, return_logprob=True)
    eng = InProcessEngine(model_path=path, dtype="float32", device="cpu", enable_shared_experts_fusion=True)
    apart, routed = [], []
    for m in eng.runner.model.moe_layers():
        assert m.shared_apart_from == SHARED_APART_TOKENS
        m.shared_apart_from = apart_from
        route = m.route

        def spy(x, route=route, k=m.top_k):
            ids, w = route(x)
            (apart if ids.shape[1] == k else routed).append(x.shape[0])
            return ids, w
        m.route = spy
    fused = eng.run(prompts, GREEDY, return_logprob=True)
    assert apart and all(t >= apart_from for t in apart) and all(t < apart_from for t in routed)
    assert bool(routed) == (apart_from > 4)
    assert [r["output_ids"] for r in fused] == [r["output_ids"] for r in plain]
    for a, b in zip(fused, plain, strict=True):
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4)


def test_concatenated_shared_slots(tiny_checkpoint):
    """Where a slot map sits between the gate and the dispatch (a placement file), the layer appends the shared
    slots itself: the same tokens as the gate appending them."""
    path = tiny_checkpoint("v3_groups")
    prompts = _prompts(8, [4, 21])
    out = []
    for gate_appends in (True, False):
        eng = InProcessEngine(model_path=path, dtype="float32", device="cpu", enable_shared_experts_fusion=True)
        for m in eng.runner.model.moe_layers():
            assert m._gate_appends and m.gate.append is not None
            if not gate_appends:
                m.gate.append, m._gate_appends = None, False
        out.append([r["output_ids"] for r in eng.run(prompts, GREEDY)])
    assert out[0] == out[1]


def test_fused_slots_hold_the_shared_mlp(tiny_checkpoint):
    """The extra slots' experts, summed, are the shared MLP on fresh random inputs."""
    path = tiny_checkpoint("v2_lite")
    plain = InProcessEngine(model_path=path, dtype="float32", device="cpu")
    fused = InProcessEngine(model_path=path, dtype="float32", device="cpu", enable_shared_experts_fusion=True)
    mp, mf = plain.runner.model.moe_layers()[0], fused.runner.model.moe_layers()[0]
    x = torch.randn(7, mp.experts.hidden_size, generator=torch.Generator().manual_seed(3))
    w13, w2 = mf.experts.w13, mf.experts.w2
    total = torch.zeros_like(x)
    for slot in mf.shared_ids.tolist():
        g, u = (x @ w13[slot].T).chunk(2, dim=-1)
        total += (torch.nn.functional.silu(g) * u) @ w2[slot].T
    torch.testing.assert_close(total, mp.shared_experts(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(tp_size=2, ep_size=2), "one EP rank"),
    (dict(enable_eplb=True, expert_distribution_recorder_mode="stat"), "without --enable-eplb"),
    (dict(ep_num_redundant_experts=2), "without --enable-eplb"),
])
def test_refused_flags(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(model_path="x", enable_shared_experts_fusion=True, **kwargs)


def test_refused_models(tiny_checkpoint):
    with pytest.raises(ValueError, match="has no shared experts"):
        InProcessEngine(model_path=tiny_checkpoint("mixtral"), device="cpu", enable_shared_experts_fusion=True)
    with pytest.raises(ValueError, match="do not split on the 128 x 128 scale blocks"):  # 2 shared of 32
        InProcessEngine(model_path=tiny_checkpoint("v2_lite"), device="cpu", dtype="float32", quantization="fp8",
                        enable_shared_experts_fusion=True)


def test_fp8_fused_equals_unfused(fp8_checkpoint):
    """A DeepSeek FP8 checkpoint (one shared expert of 192, padded to whole blocks like the routed ones): the slot
    takes the shared MLP's FP8 weights and scales as they are; the same greedy tokens and logprobs as unfused."""
    path, _ = fp8_checkpoint
    prompts = _prompts(9, [6, 30, 11])
    runs = {}
    for fused in (False, True):
        eng = InProcessEngine(model_path=path, dtype="float32", device="cpu", enable_shared_experts_fusion=fused)
        runs[fused] = eng.run(prompts, GREEDY, return_logprob=True)
        for m in eng.runner.model.moe_layers():
            assert (m.shared_experts is None) == fused
            assert m.experts.w13_scale_inv.shape[0] == m.experts.w13.shape[0] == m.experts.num_local_experts + fused
            assert m.shared_apart_from is None  # FP8 slots stay in the grouped GEMM at every size
    assert [r["output_ids"] for r in runs[True]] == [r["output_ids"] for r in runs[False]]
    for a, b in zip(runs[True], runs[False], strict=True):
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4)


def test_fp8_slots_split_on_blocks():
    """Two FP8 shared experts of 128 each: slot j holds gate rows, up rows and down columns j of the MLP, with their
    scale blocks; the slots' dequantized sum is the MLP's."""
    from moeserve.kernels.fp8_quant import dequantize_weight, quantize_weight
    from moeserve.layers.quantization.fp8_mlp import Fp8GatedMLP

    gen = torch.Generator().manual_seed(2)
    mlp = Fp8GatedMLP(200, 256)
    gate_up, down = torch.randn(512, 200, generator=gen) * 0.1, torch.randn(200, 256, generator=gen) * 0.1
    mlp.gate_up_proj.data, mlp.gate_up_proj_scale_inv.data = quantize_weight(gate_up)
    mlp.down_proj.data, mlp.down_proj_scale_inv.data = quantize_weight(down)
    slots = mlp.expert_slots(2)
    assert slots["w13"].shape == (2, 256, 200) and slots["w13_scale_inv"].shape == (2, 2, 2)
    assert slots["w2"].shape == (2, 200, 128) and slots["w2_scale_inv"].shape == (2, 2, 1)
    x = torch.randn(5, 200, generator=gen)
    dense_gu = dequantize_weight(mlp.gate_up_proj, mlp.gate_up_proj_scale_inv, torch.float32)
    dense_d = dequantize_weight(mlp.down_proj, mlp.down_proj_scale_inv, torch.float32)
    g, u = (x @ dense_gu.T).chunk(2, dim=-1)
    want = (torch.nn.functional.silu(g) * u) @ dense_d.T
    got = torch.zeros_like(want)
    for j in range(2):
        w13 = dequantize_weight(slots["w13"][j], slots["w13_scale_inv"][j], torch.float32)
        w2 = dequantize_weight(slots["w2"][j], slots["w2_scale_inv"][j], torch.float32)
        gj, uj = (x @ w13.T).chunk(2, dim=-1)
        got += (torch.nn.functional.silu(gj) * uj) @ w2.T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("apart_from", [None, 64])
def test_fused_equals_unfused_on_cuda(tiny_checkpoint, apart_from):
    """The Triton grouped GEMMs, routing and combine with the fused slots, under decode and piecewise graphs;
    apart_from 64: the prefill steps run the slots apart (captured so in the piecewise graphs), the decodes routed."""
    path = tiny_checkpoint("v2_lite")
    prompts = _prompts(6, [5, 33, 12, 70])
    runs = []
    for fused in (False, True):
        eng = InProcessEngine(model_path=path, dtype="float32", device="cuda", max_total_tokens=4096,
                              cuda_graph_max_bs=8, piecewise_cuda_graph_max_tokens=256,
                              enable_shared_experts_fusion=fused, disable_shared_experts_fusion=not fused)
        if fused and apart_from is not None:
            for m in eng.runner.model.moe_layers():
                m.shared_apart_from = apart_from
        runs.append(eng.run(prompts, GREEDY, return_logprob=True))
    assert [r["output_ids"] for r in runs[1]] == [r["output_ids"] for r in runs[0]]
    for a, b in zip(runs[1], runs[0], strict=True):
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_fused_equals_unfused_on_cuda(fp8_checkpoint):
    """The block-FP8 grouped GEMMs with the shared slot (its scales beside the routed experts'), in bf16."""
    path, _ = fp8_checkpoint
    prompts = _prompts(4, [5, 33, 12])
    runs = [InProcessEngine(model_path=path, dtype="bfloat16", device="cuda", max_total_tokens=4096,
                            cuda_graph_max_bs=8, piecewise_cuda_graph_max_tokens=256,
                            enable_shared_experts_fusion=fused).run(prompts, GREEDY) for fused in (False, True)]
    same = sum(a["output_ids"] == b["output_ids"] for a, b in zip(runs[0], runs[1], strict=True))
    assert same >= len(prompts) - 1, same  # bf16 roundings of the slot's sum may flip a near tie


@pytest.mark.parametrize(("kwargs", "device", "inter", "fused"), [
    (dict(), "cuda", 1408, True),  # the default on one CUDA rank
    (dict(), "cpu", 1408, False),
    (dict(disable_shared_experts_fusion=True), "cuda", 1408, False),
    (dict(enable_shared_experts_fusion=True), "cpu", 1408, True),
    (dict(quantization="fp8"), "cuda", 1408, True),  # two shared experts of 11 scale blocks each
    (dict(quantization="fp8"), "cuda", 1400, False),  # they would split a scale block
    (dict(), "cuda", 1400, True),
    (dict(expert_distribution_recorder_mode="stat"), "cuda", 1408, False),
    (dict(moe_runner_backend="grouped_gemm"), "cuda", 1408, False),
    (dict(moe_a2a_backend="all2all"), "cuda", 1408, False),  # its slots hold top_k ids; prefill runs them apart
])
def test_fusion_default(kwargs, device, inter, fused):
    from types import SimpleNamespace

    from moeserve.models.options import fuse_shared_experts

    config = SimpleNamespace(architecture="DeepseekV2ForCausalLM", num_shared_experts=2, moe_intermediate_size=inter,
                             fp8=None)
    assert fuse_shared_experts(ServerArgs(model_path="x", **kwargs), config, torch.device(device)) is fused
    mixtral = SimpleNamespace(architecture="MixtralForCausalLM", num_shared_experts=0, fp8=None)
    assert not fuse_shared_experts(ServerArgs(model_path="x"), mixtral, torch.device("cuda"))
    with pytest.raises(ValueError, match="moe-a2a-backend none"):
        ServerArgs(model_path="x", enable_shared_experts_fusion=True, moe_a2a_backend="all2all")
    with pytest.raises(ValueError, match="contradict"):
        ServerArgs(model_path="x", enable_shared_experts_fusion=True, disable_shared_experts_fusion=True)


@pytest.mark.parametrize("name", ["v2_lite", "v3_groups"])
def test_fused_slots_apart_over_packed_experts(tiny_checkpoint, name):
    """bf16 experts held packed (the CPU kernels of the amx and avx512bf16 builds): the fused shared slots run apart
    through the packed kernel, every token to each slot, and give the shared MLP of their logical weights."""
    from moeserve.kernels import cpu_experts

    if not cpu_experts.packed_runs():
        pytest.skip("the packed experts kernels do not run on this CPU")
    eng = InProcessEngine(model_path=tiny_checkpoint(name), dtype="bfloat16", device="cpu",
                          enable_shared_experts_fusion=True)
    n = eng.runner.config.num_shared_experts
    gen = torch.Generator().manual_seed(3)
    for m in eng.runner.model.moe_layers():
        ex = m.experts
        assert ex.packed and ex.w13.shape[0] == ex.num_local_experts + n
        m.shared_apart_from = 1
        x = torch.randn(7, ex.hidden_size, generator=gen).bfloat16()
        w13, w2 = (w.double() for w in ex.logical_weights())
        want = sum(torch.nn.functional.silu(x.double() @ w13[j, :ex.intermediate_size].T)
                   * (x.double() @ w13[j, ex.intermediate_size:].T) @ w2[j].T
                   for j in range(ex.num_local_experts, ex.num_local_experts + n))
        torch.testing.assert_close(m._shared_out(x).double(), want, rtol=3e-2, atol=3e-2)
