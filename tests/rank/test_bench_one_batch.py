"""`moeserve bench one-batch`: runs on the embedded model beside transformers and reports medians of its rounds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeserve.bench.one_batch import main


def test_one_batch_with_transformers(tmp_path, capsys):
    result = tmp_path / "r.jsonl"
    # float32: the shipped model is bfloat16, where the two systems' roundings differ enough to change tokens
    assert main(["--batch-size", "1", "3", "--input-len", "9", "--output-len", "5", "--repeat", "2", "--dtype",
                 "float32", "--compare-transformers", "--result-file", str(result)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("batch")]
    assert len(lines) == 2 and all("speedup prefill" in ln for ln in lines)
    rows = [json.loads(ln) for ln in result.read_text().splitlines()]
    assert [r["batch_size"] for r in rows] == [1, 3]
    for r in rows:
        for system in ("moeserve", "transformers"):
            m = r[system]
            assert m["rounds"] == 2 and len(m["decode_tok_s_all"]) == 2
            assert m["decode_tok_s"] > 0 and m["prefill_tok_s"] > 0
            assert min(m["decode_tok_s_all"]) <= m["decode_tok_s"] <= max(m["decode_tok_s_all"])
        assert r["decode_speedup"] == r["moeserve"]["decode_tok_s"] / r["transformers"]["decode_tok_s"]
        t = r["transformers"]["tokens"]
        assert t["requests"] == r["batch_size"] and (t["equal"] == t["requests"] or t["near_ties_only"])


@pytest.mark.parametrize("fused", [False, True])
def test_dummy_weights_are_the_same_in_both(capsys, fused):
    """--load-format dummy: transformers runs moeserve's dummy weights, so the greedy tokens agree; also with the
    shared experts fused into the routed experts' slots (the default on one CUDA rank), whose loaded model no longer
    names the shared experts' tensors (transformers drew its own for them, and differed from the first token)."""
    config = str(Path(__file__).parents[2] / "benchmarks" / "configs" / "deepseek-v3-tiny-kv512")
    assert main(["--model-path", config, "--load-format", "dummy", "--batch-size", "3", "--input-len", "6",
                 "--output-len", "6", "--compare-transformers"]
                + (["--enable-shared-experts-fusion"] if fused else [])) == 0
    out = capsys.readouterr().out
    assert "greedy tokens: 3/3 requests equal to transformers'" in out, out


def test_profile_parts_name_the_decode_kernels():
    """The per-part table of `bench one-batch --profile` sorts kernel names into the parts (first rule wins)."""
    from moeserve.bench.step_profile import classify, format_table

    for kernel in ("_moe_gemm_kernel", "_moe_gemm_wgmma_kernel", "_fp8_grouped_kernel", "_fp8_grouped_wgmma_kernel"):
        assert classify(kernel) == "experts", kernel  # the grouped GEMMs: bf16 and FP8, Triton's and Gluon's
    assert classify("_place_kernel") == "dispatch" and classify("_select_kernel") == "dispatch"
    assert classify("_quantize_groups_kernel") == "fp8 quant"
    assert classify("_extend_attention_kernel") == "attention"
    assert classify("_router_logits_kernel") == "dispatch"
    assert classify("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13Gemm"
                    "UniversalINS5_17GroupProblemShapeIN4cute5tupleIJiiiEEEEENS") == "experts"  # torch._grouped_mm
    assert classify("_rms_norm_kernel") == "norms"
    assert classify("_mla_decode_combine_kernel") == "attention" and classify("_combine_kernel") == "dispatch"
    assert classify("_mla_rope_cache_kernel") == "attention"
    assert classify("void cutlass_75_tensorop_bf16_s1688gemm_bf16_64x64_sliced1x2_nn_align8") == "attention"
    assert classify("nvjet_tst_128x64_64x4_1x2_h_bz_coopA_NNT") == "dense GEMMs"
    assert classify("vectorized_elementwise_kernel") == "other"
    table = format_table("decode step at batch 64", {
        "step_ms": 10.0, "device_ms": 8.0, "host_ms": 2.0, "kernels_per_step": 100,
        "parts_ms": {"experts": 5.0, "other": 3.0}, "other_top": {"elementwise": 3.0},
        "top": {"experts": [["_moe_gemm_kernel", 4.5, 52], ["nvjet_grouped", 0.5, 2]]}})
    assert "experts" in table and "50.0%" in table and "host" in table and "20.0%" in table
    assert "4.500 ms x52   _moe_gemm_kernel" in table  # each part's kernels by time, under it
    assert table.count("attention") == 1


def test_profile_is_refused_without_cuda(capsys):
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a CPU-only host")
    with pytest.raises(SystemExit, match="--profile needs a CUDA device"):
        main(["--batch-size", "1", "--input-len", "4", "--output-len", "2", "--profile"])


def test_all2all_dispatch_on_one_rank(tmp_path):
    """The EP dispatchers talk through torch.distributed even on one rank: the benchmark sets up the one-rank group
    the server's worker would (in a child process, so this process keeps no group), and its tokens are
    transformers'."""
    import subprocess
    import sys

    result = tmp_path / "r.jsonl"
    cmd = [sys.executable, "-m", "moeserve.cli", "bench", "one-batch", "--moe-a2a-backend", "all2all",
           "--deepep-mode", "auto", "--dtype", "float32", "--batch-size", "2", "--input-len", "7",
           "--output-len", "4", "--compare-transformers", "--result-file", str(result)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    t = json.loads(result.read_text())["transformers"]["tokens"]
    assert t["requests"] == 2 and (t["equal"] == 2 or t["near_ties_only"])
