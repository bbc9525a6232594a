"""The Gluon block-scaled FP8 grouped GEMM (triton_ops/fp8_grouped_wgmma.py). Gluon has no interpreter: on CPU the
kernel is compiled for an sm_90 GPU (Triton's own compiler and ptxas, no device needed), which checks that every
tile form builds warp-specialized, without spills or serialized MMAs; on a GPU each form runs against the torch
reference, in both layouts, with ragged experts (empty ones, a single row, partial tiles) and both layouts of the
activation scales."""

from __future__ import annotations

import re

import pytest
import torch

from moeserve.kernels.fp8_grouped_gemm import fp8_grouped_gemm_masked_reference, fp8_grouped_gemm_reference
from moeserve.kernels.fp8_quant import quantize_activations_reference, quantize_weight, scales_mn_major
from tests.kernels.gluon_build import compile_for_hopper, ptxas_report

gluon = pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper", reason="Triton without Gluon")

FORMS = [dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=4, GROUP_M=8, TILE_MAP=True),
         dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=6, GROUP_M=16, TILE_MAP=True),
         dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=3, GROUP_M=1),
         # PAIRS (decode): two 64-row tiles at once, a warpgroup each, each with half of the slots
         dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=8, GROUP_M=8, PAIRS=True),
         dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=6, GROUP_M=1, PAIRS=True, TILE_MAP=True),
         # SWAP_AB (decode): the weights' rows on the MMA's M side, a's few rows on its N side
         dict(BLOCK_M=32, BLOCK_N=128, num_warps=4, num_stages=4, GROUP_M=8, SWAP_AB=True),
         dict(BLOCK_M=16, BLOCK_N=128, num_warps=4, num_stages=8, GROUP_M=1, SWAP_AB=True),
         dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=5, GROUP_M=8, SWAP_AB=True)]
WGMMA_REL = 5e-4  # as tests/kernels/test_fp8_kernels.py: the warpgroup MMA's reduced-precision sums a K block


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


def _compile(cfg: dict, masked: bool):
    from triton.experimental.gluon import language as gl

    from moeserve.kernels.triton_ops import fp8_grouped_wgmma as g

    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    la = gl.NVMMASharedLayout.get_default_for([bm, 128], gl.float8e4nv)
    lb = gl.NVMMASharedLayout.get_default_for([bn, 128], gl.float8e4nv)
    sig = dict(a_desc=f"tensordesc<fp8e4nv[{bm}, 128],{la!r}>", b_desc=f"tensordesc<fp8e4nv[{bn}, 128],{lb!r}>",
               as_ptr="*fp32", bs_ptr="*fp32", c_ptr="*bf16", starts_ptr="*i32", counts_ptr="*i32", map_ptr="*i32")
    consts = dict(E=64, E_P2=64, TILE_MAP=g.map_tiles(cfg, masked), MASKED=masked, BLOCK_M=bm,
                  BLOCK_N=bn, GROUP_M=cfg["GROUP_M"], STAGES=cfg["num_stages"], PAIRS=bool(cfg.get("PAIRS")),
                  num_warps=cfg["num_warps"])
    return compile_for_hopper(g._fp8_grouped_wgmma_kernel, sig, consts)


@pytest.mark.parametrize("cfg", FORMS)
@pytest.mark.parametrize("masked", [False, True])
def test_compiles_for_hopper_warp_specialized(cfg, masked, tmp_path):
    """Each form builds for sm_90 as three partitions (registers moved between them with setmaxnreg), its MMAs
    waited for in full, without spills, and without ptxas serializing its MMAs (warning C7514)."""
    ptx = _compile(cfg, masked).asm["ptx"]
    assert "wgmma.mma_async" in ptx and "e4m3" in ptx and "setmaxnreg" in ptx
    assert set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx)) == {"0"}
    info = ptxas_report(ptx, tmp_path)
    assert "C7514" not in info and " 0 bytes spill stores" in info, info


cuda = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                          reason="the warpgroup MMA needs a Hopper-class GPU")


def _contiguous(counts: list[int], n: int, k: int, seed: int):
    """Random rows of the given counts an expert, quantized; k / 128 K steps (odd or even: a warpgroup runs the
    steps two at a time, an odd last one on its own)."""
    gen = torch.Generator().manual_seed(seed)
    c = torch.tensor(counts, dtype=torch.int32)
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(c, 0)
    xq, xs = quantize_activations_reference(torch.randn(int(offsets[-1]), k, generator=gen))
    wq, ws = quantize_weight(torch.randn(len(counts), n, k, generator=gen))
    return xq, xs, wq, ws, offsets, c


@cuda
@pytest.mark.parametrize("cfg", FORMS)
@pytest.mark.parametrize("counts", [[0, 37, 1, 0, 200], [1], [130, 64, 0, 3]])
@pytest.mark.parametrize("mn_major", [False, True])
def test_contiguous_matches_reference(cfg, counts, mn_major):
    from moeserve.kernels.triton_ops.fp8_grouped_gemm import _wgmma_usable, fp8_grouped_gemm

    args = _contiguous(counts, 256, 384 if mn_major else 256, seed=len(counts))  # 3 K steps, or 2
    if mn_major:
        args = (args[0], scales_mn_major(args[1]), *args[2:])
    ref = fp8_grouped_gemm_reference(*args, torch.float32)
    dev = [t.cuda() for t in args]
    assert _wgmma_usable(dev[0], dev[2], dict(cfg, WGMMA=True))
    got = fp8_grouped_gemm(*dev, torch.bfloat16, config=dict(cfg, WGMMA=True)).float().cpu()
    assert _rel(got, ref) < WGMMA_REL + 4e-3  # bf16 output: 8 mantissa bits


@cuda
@pytest.mark.parametrize("cfg", FORMS)
@pytest.mark.parametrize("mn_major", [False, True])
@pytest.mark.parametrize("k", [512, 128])  # 4 K steps, or a single one (the odd last step alone)
def test_masked_matches_reference(cfg, mn_major, k):
    from moeserve.kernels.triton_ops.fp8_grouped_gemm import fp8_grouped_gemm_masked

    gen = torch.Generator().manual_seed(21)
    xq, xs = quantize_activations_reference(torch.randn(3, 140, k, generator=gen), mn_major)
    wq, ws = quantize_weight(torch.randn(3, 256, k, generator=gen))
    masked_m = torch.tensor([17, 0, 140], dtype=torch.int32)
    ref = fp8_grouped_gemm_masked_reference(xq, xs, wq, ws, masked_m, torch.float32)
    got = fp8_grouped_gemm_masked(*(t.cuda() for t in (xq, xs, wq, ws, masked_m)), torch.bfloat16,
                                  config=dict(cfg, WGMMA=True)).float().cpu()
    for i, mm in enumerate(masked_m.tolist()):
        if mm:
            assert _rel(got[i, :mm], ref[i, :mm]) < WGMMA_REL + 4e-3


@cuda
def test_fp32_output_and_the_triton_kernel_agree():
    """fp32 out: the Gluon kernel against the Triton kernel on the same tiles, at a prefill-like size."""
    from moeserve.kernels.triton_ops.fp8_grouped_gemm import fp8_grouped_gemm

    counts = torch.randint(0, 300, (16,), generator=torch.Generator().manual_seed(3)).tolist()
    dev = [t.cuda() for t in _contiguous(counts, 512, 1024, seed=4)]
    cfg = dict(FORMS[0], TMA=True)
    a = fp8_grouped_gemm(*dev, torch.float32, config=dict(cfg, WGMMA=True))
    b = fp8_grouped_gemm(*dev, torch.float32, config=cfg)
    assert _rel(a, b) < WGMMA_REL
