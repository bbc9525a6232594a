"""The tuned launch tables: the nearest row count's entry, the default without a file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moeserve.kernels import moe_config


def test_nearest_entry_and_default(tmp_path, monkeypatch):
    monkeypatch.setattr(moe_config, "CONFIG_DIR", tmp_path)
    moe_config._lookup.cache_clear()
    moe_config._load.cache_clear()
    moe_config._nearest_tuned_e.cache_clear()
    small = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4)
    path = moe_config.config_file("moe_gemm", 8, 64, 32, torch.bfloat16, moe_config.device_name())
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"6": small, "4096": {"backend": "torch"}}))
    assert moe_config.get_config("moe_gemm", 100, 8, 64, 32, torch.bfloat16) == small
    assert moe_config.get_config("moe_gemm", 3000, 8, 64, 32, torch.bfloat16) == {"backend": "torch"}
    got = moe_config.get_config("moe_gemm", 100, 8, 64, 32, torch.float32)  # no table for fp32: the default
    assert got == moe_config.default_config(100, 8)
    got["BLOCK_M"] = 1  # callers get a copy: the cached entry stays
    assert moe_config.get_config("moe_gemm", 100, 8, 64, 32, torch.float32)["BLOCK_M"] != 1
    moe_config._lookup.cache_clear()
    moe_config._nearest_tuned_e.cache_clear()


def test_another_expert_count_lends_its_table(tmp_path, monkeypatch):
    """Shared-experts fusion (64 routed + 2 shared slots) and EP ranks (32 local of 64) read the 64 experts' table
    at the same rows per expert; another shape or dtype does not."""
    monkeypatch.setattr(moe_config, "CONFIG_DIR", tmp_path)
    for cache in (moe_config._lookup, moe_config._load, moe_config._nearest_tuned_e):
        cache.cache_clear()
    small = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4)
    big = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
    path = moe_config.config_file("moe_gemm", 64, 2048, 1408, torch.bfloat16, moe_config.device_name())
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"8": small, "1024": big, "16384": {"backend": "torch"}}))
    get = moe_config.get_config
    assert get("moe_gemm", 8, 66, 2048, 1408, torch.bfloat16) == small
    assert get("moe_gemm", 8192 * 8, 66, 2048, 1408, torch.bfloat16) == {"backend": "torch"}
    assert get("moe_gemm", 300, 32, 2048, 1408, torch.bfloat16) == big  # 300 of 32 experts: 600 of 64
    assert get("moe_gemm", 300, 64, 2048, 1408, torch.bfloat16) == small  # nearest to 300 itself: 8 over 1024
    assert get("moe_gemm", 300, 66, 2048, 1024, torch.bfloat16) == moe_config.default_config(300, 66)
    assert get("moe_gemm", 300, 66, 2048, 1408, torch.float32) == moe_config.default_config(300, 66)
    for cache in (moe_config._lookup, moe_config._load, moe_config._nearest_tuned_e):
        cache.cache_clear()


def test_shipped_tables_parse():
    for path in moe_config.CONFIG_DIR.glob("*/*.json"):
        table = json.loads(path.read_text())
        assert table and all(int(m) > 0 for m in table), path
        need = {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}
        if not path.parent.name.startswith("fp8_"):  # the FP8 kernels' K step is the 128-wide scale block
            need.add("BLOCK_K")
        known = need | {"BLOCK_K", "GROUP_M", "TMA", "A_TMA", "SCALE_AHEAD", "SPLIT_K", "maxnreg"}  # the kernels' launch options
        if not path.parent.name.endswith("_masked"):
            known.add("TILE_MAP")  # (the contiguous layout's)
        if path.parent.name.startswith("fp8_grouped_gemm"):
            known |= {"WGMMA", "SWAP_AB", "PAIRS"}  # the Gluon kernel (triton_ops/fp8_grouped_wgmma.py)
        if path.parent.name.startswith("moe_gemm"):
            known.add("WGMMA")  # the Gluon kernel (triton_ops/moe_gemm_wgmma.py)
        for cfg in table.values():
            # a picker's other backend: torch's grouped GEMM (bf16 MoE), cuBLAS's block-scaled GEMM (FP8 linear)
            other = {"backend": "cublas" if path.parent.name == "fp8_gemm" else "torch"}
            assert cfg == other or need <= set(cfg) <= known, (path, cfg)  # a misspelt option would do nothing


def test_shipped_expert_tables_reach_decode():
    """An expert table's smallest entry is at most 16 rows an expert: the nearest-key lookup would otherwise give a
    decode batch (a few rows an expert) a prefill-sized tile (a table tuned at prefill sizes alone once sent
    DeepSeek-V3's FP8 decode to the 128-row Gluon tile)."""
    for op in ("moe_gemm", "moe_gemm_silu", "fp8_grouped_gemm", "fp8_grouped_gemm_masked"):
        for path in (moe_config.CONFIG_DIR / op).glob("*.json"):
            experts = int(path.name.split(",", 1)[0].removeprefix("E="))
            smallest = min(int(m) for m in json.loads(path.read_text()))
            assert smallest <= 16 * experts, (path.name, smallest)


def test_a_gpu_shape_without_a_table_is_logged_once(tmp_path, monkeypatch, caplog):
    """A shape a GPU has no table for runs the default tile (DeepSeek-V3's FP8 linear layers did, at half cuBLAS's
    speed, 2026-12-04): a warning names the op, the shape, the device and the tuner, once a shape; CPU runs (no
    tables by design) stay quiet."""
    monkeypatch.setattr(moe_config, "CONFIG_DIR", tmp_path)
    for cache in (moe_config._lookup, moe_config._load, moe_config._nearest_tuned_e):
        cache.cache_clear()
    fp8 = torch.float8_e4m3fn
    with caplog.at_level("WARNING", logger=moe_config.__name__):
        for m in (64, 8192):
            moe_config._lookup("fp8_gemm", m, 1, 7168, 16384, fp8, "NVIDIA_H200", moe_config.default_config)
        moe_config._lookup("fp8_gemm", 64, 1, 7168, 16384, fp8, "cpu", moe_config.default_config)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1, warned
    assert "fp8_gemm" in warned[0] and "N=7168 K=16384" in warned[0] and "NVIDIA_H200" in warned[0]
    assert "tune_fp8.py --dense" in warned[0]
    for cache in (moe_config._lookup, moe_config._load, moe_config._nearest_tuned_e):
        cache.cache_clear()


def _fp8_shapes_that_run(path: str) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
    """The benchmark model's FP8 GEMM shapes as its layers run them on one GPU: the linear layers (q + kv_a as the
    one fused GEMM), the dense MLPs as fp8_mlp.py pads them, the routed experts' (N, K) (the shared experts run as
    expert slots there). Built on the meta device, loaded as after a checkpoint: (dense N x K, experts' N x K)."""
    from moeserve.core.model_config import ModelConfig
    from moeserve.layers.quantization.fp8 import to_fp8
    from moeserve.layers.quantization.fp8_experts import Fp8Experts
    from moeserve.layers.quantization.fp8_linear import _Fp8Weight
    from moeserve.layers.quantization.fp8_mlp import Fp8GatedMLP
    from moeserve.models.loader import finish_loading, get_model_class

    config = ModelConfig.from_pretrained(path)
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, None)
        to_fp8(model, torch.bfloat16)
    finish_loading(model, torch.device("meta"))
    dense, experts = set(), set()
    for name, module in model.named_modules():
        fused = getattr(module, "_qkv_a", None)
        if fused is not None:  # its two parts' weights are views of the fused one: only it runs
            dense.add(tuple(fused.__self__.weight.shape))
        parent = name.rsplit(".", 1)[0]
        if isinstance(module, _Fp8Weight) and not (
                name.rsplit(".", 1)[-1] in ("q_proj", "q_a_proj", "kv_a_proj_with_mqa")
                and model.get_submodule(parent)._qkv_a is not None):
            dense.add(tuple(module.weight.shape))
        if isinstance(module, Fp8GatedMLP) and "shared_experts" not in name:
            dense |= {tuple(module.gate_up_proj.shape), tuple(module.down_proj.shape)}
        if isinstance(module, Fp8Experts):
            experts |= {tuple(module.w13.shape[1:]), tuple(module.w2.shape[1:])}
    return dense, experts


@pytest.mark.parametrize("model", ["deepseek-v2-lite", "deepseek-v3-4layer"])
def test_the_benchmark_models_fp8_shapes_have_h200_tables(model):
    """Every FP8 GEMM the benchmark models run on one H200 has a tuned table (V3's linear layers had none and ran
    the default tile at half cuBLAS's speed; V2-Lite's dense MLP's were keyed by its unpadded width, 2026-12-04)."""
    from moeserve.kernels.fp8_format import FP8_DTYPE

    root = Path(__file__).resolve().parents[2]
    dense, experts = _fp8_shapes_that_run(str(root / "benchmarks" / "configs" / model))
    assert dense and experts
    missing = [f"fp8_gemm {n}x{k}" for n, k in sorted(dense)
               if not moe_config.config_file("fp8_gemm", 1, n, k, FP8_DTYPE, "NVIDIA_H200").exists()]
    for n, k in sorted(experts):
        rest = moe_config.config_file("fp8_grouped_gemm", 1, n, k, FP8_DTYPE, "NVIDIA_H200").name.split(",", 1)[1]
        for op in ("fp8_grouped_gemm", "fp8_grouped_gemm_masked"):
            if not list((moe_config.CONFIG_DIR / op).glob(f"E=*,{rest}")):
                missing.append(f"{op} {n}x{k}")
    assert not missing, missing
