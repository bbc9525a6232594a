"""FP8 block quantization and the block-scaled GEMMs: the recipe's properties, and each Triton kernel against its
torch reference (on the CPU under TRITON_INTERPRET=1, see conftest.py; on the GPU when there is one). Shapes have
partial blocks at the ends of M, N and K."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moeserve.kernels.fp8_gemm import fp8_gemm_reference, fp8_linear
from moeserve.kernels.fp8_grouped_gemm import fp8_grouped_gemm_masked_reference, fp8_grouped_gemm_reference
from moeserve.kernels.fp8_quant import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_activations,
    dequantize_weight,
    quantize_activations_reference,
    quantize_weight,
    scales_mn_major,
)

SMALL = dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=2)  # several tiles on small shapes
GROUPED_2 = dict(SMALL, GROUP_M=2)
WIDE_N = dict(SMALL, BLOCK_N=256)  # a tile over two 128-column scale blocks: b's scales per column
FP8_REL = 0.07  # relative error of an e4m3 GEMM against fp32 (3 mantissa bits on both operands)
KERNEL_REL = 1e-5  # Triton against the reference: the same products, summed in another order
# Hopper's FP8 warpgroup MMA (tiles of 64 rows or more) sums each 128-wide K block at reduced precision before the
# kernel adds it to the fp32 accumulator, as DeepSeek's recipe expects (promotion every 128): 1.1e-4 to 1.3e-4 was
# measured on an H200 (2026-12-01) with pointer and descriptor reads alike; 16-row tiles measure 3e-7
WGMMA_REL = 5e-4


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


def test_weight_recipe_blocks_and_partial_blocks():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=gen)
    w[130:200, 0:128] *= 100.0  # a block of large values keeps its own scale
    q, s = quantize_weight(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and s.shape == (3, 2) and s.dtype == torch.float32
    assert torch.allclose(s[2, 1], w[256:, 128:].abs().max() / FP8_MAX)  # the partial corner block
    assert torch.allclose(s[1, 0], w[128:256, :128].abs().max() / FP8_MAX)
    back = dequantize_weight(q, s)
    assert (back - w).abs().max() <= (w.abs().max() / 16)  # e4m3: 3 mantissa bits
    assert _rel(back, w) < 0.04
    # the largest entry of each block lands on 448
    assert q[256:, 128:].float().abs().max() == FP8_MAX
    zeros_q, zeros_s = quantize_weight(torch.zeros(5, 7))
    assert (zeros_q.float() == 0).all() and (zeros_s > 0).all()


def test_activation_recipe_per_token_groups():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 300, generator=gen)
    x[1] *= 50.0
    q, s = quantize_activations_reference(x)
    assert q.shape == x.shape and s.shape == (4, 3)
    assert torch.allclose(s[1, 2], x[1, 256:].abs().max() / FP8_MAX)
    assert _rel(dequantize_activations(q, s), x) < 0.04


def test_reference_gemm_is_close_to_fp32():
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(9, 260, generator=gen), torch.randn(150, 260, generator=gen)
    wq, ws = quantize_weight(w)
    y = fp8_linear(x, wq, ws)
    assert y.shape == (9, 150) and y.dtype == torch.float32
    assert _rel(y, x @ w.t()) < FP8_REL
    # the reference is exactly dequantize-then-matmul
    xq, xs = quantize_activations_reference(x)
    torch.testing.assert_close(fp8_gemm_reference(xq, xs, wq, ws, torch.float32),
                               dequantize_activations(xq, xs) @ dequantize_weight(wq, ws).t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_silu_and_mul_quant_matches_reference(dtype, device):
    """silu(gate) * up straight to FP8 (I = 300: a partial group) against the two ops then the quantizer."""
    from moeserve.kernels.fp8_quant import silu_and_mul_quantize_reference
    from moeserve.kernels.triton_ops.fp8_quant import silu_and_mul_quantize

    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(3, 7, 600, generator=gen) * torch.rand(3, 7, 1, generator=gen) * 6).to(dtype)
    q, s = silu_and_mul_quantize(x.to(device))
    rq, rs = silu_and_mul_quantize_reference(x)
    assert q.shape == rq.shape == (3, 7, 300) and s.shape == rs.shape == (3, 7, 3)
    s2 = silu_and_mul_quantize(x.to(device), mn_major=True)[1]  # the same scales, stored [groups, rows]
    assert s2.stride() == (7, 1, 21) and torch.equal(s2, s)
    # F.silu's exp and Triton's may differ in the last fp32 bit, which the rounding to x's dtype mostly absorbs;
    # Triton 3.9's interpreter also rounds to bf16 its own way (up to a few bf16 steps of a group's largest value)
    loose = device == "cpu" and dtype == torch.bfloat16
    torch.testing.assert_close(s.cpu(), rs, rtol=3e-2 if loose else 1e-2, atol=0)
    got, ref = dequantize_activations(q.cpu(), s.cpu()), dequantize_activations(rq, rs)
    assert (got - ref).abs().max() <= 2 ** -3 * ref.abs().max()  # within an e4m3 step of the group's largest
    assert (q.cpu().float() == rq.float()).float().mean() > (0.8 if loose else 0.9)


def test_triton_activation_quant_matches_reference(device):
    from moeserve.kernels.triton_ops.fp8_quant import quantize_activations

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 300, generator=gen) * torch.rand(2, 5, 1, generator=gen) * 10
    q, s = quantize_activations(x.to(device))
    rq, rs = quantize_activations_reference(x)
    assert q.shape == rq.shape and s.shape == rs.shape
    q2, s2 = quantize_activations(x.to(device), mn_major=True)  # the same values, the scales stored [groups, rows]
    assert s2.shape == s.shape and s2.stride() == (5, 1, 10) and torch.equal(s2, s)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
    torch.testing.assert_close(s.cpu(), rs, rtol=1e-6, atol=0)
    got, ref = q.cpu().float(), rq.float()
    if device == "cpu":
        # NOTE: Triton 3.9's interpreter converts fp32 to e4m3 dropping the carry of a round-up into the next binade
        # (31.9 -> 16 instead of 32); the GPU converts in hardware (round to nearest even) and must match exactly.
        # Here every mismatch must be exactly that case: the reference a power of two, the kernel half of it.
        bad = got != ref
        assert (got[bad] * 2 == ref[bad]).all() and (ref[bad].abs().log2() % 1 == 0).all()
        assert bad.float().mean() < 0.05
    else:
        assert torch.equal(got, ref)


@pytest.mark.parametrize("k", [1100, 2048])
def test_triton_gathered_quant_matches_reference(device, k):
    """The contiguous layout's rows quantized straight from the tokens (a token in several rows, padding rows -1),
    with both scale layouts, against the gather then the quantizer. K 1,100: 9 groups a row, a partial one, the
    rows' groups laid end to end (a program's 8 groups span two rows); K 2,048: 16 groups, two programs a row."""
    from moeserve.kernels.fp8_quant import quantize_gathered_reference
    from moeserve.kernels.triton_ops.fp8_quant import quantize_gathered

    gen = torch.Generator().manual_seed(8)
    tokens = torch.randn(6, k, generator=gen) * torch.rand(6, 1, generator=gen) * 8
    pairs = torch.tensor([5, 0, -1, 11, 3, 3, -1, 17, 8], dtype=torch.int32)  # top_k 3: tokens 1, 0, 3, 1, 1, 5, 2
    for mn in (False, True):
        q, s = quantize_gathered(tokens.to(device), pairs.to(device), 3, mn_major=mn)
        rq, rs = quantize_gathered_reference(tokens, pairs, 3, mn_major=mn)
        assert q.shape == rq.shape == (9, k) and s.shape == rs.shape == (9, -(-k // 128)) and s.stride() == rs.stride()
        torch.testing.assert_close(s.cpu(), rs, rtol=1e-6, atol=0)
        assert (q[2].cpu().float() == 0).all() and (q[6].cpu().float() == 0).all()
        assert (q.cpu().float() == rq.float()).float().mean() > 0.95  # the interpreter's carry (see above)


@pytest.mark.parametrize(("m", "n", "k"), [(37, 150, 260), (1, 64, 128), (16, 32, 100), (20, 300, 256)])
def test_triton_gemm_matches_reference(device, m, n, k):
    """Row-major and M-major activation scales, tiles inside one scale block's columns and across two."""
    from moeserve.kernels.triton_ops.fp8_gemm import fp8_gemm

    gen = torch.Generator().manual_seed(m + n + k)
    xq, xs = quantize_activations_reference(torch.randn(m, k, generator=gen))
    wq, ws = quantize_weight(torch.randn(n, k, generator=gen))
    ref = fp8_gemm_reference(xq, xs, wq, ws, torch.float32)
    for scales in (xs, scales_mn_major(xs)):
        # (SCALE_AHEAD 3: the next block's scales loaded after the step's add)
        for config in (SMALL, GROUPED_2, WIDE_N, dict(SMALL, SCALE_AHEAD=3), dict(WIDE_N, SCALE_AHEAD=3)):
            got = fp8_gemm(*(t.to(device) for t in (xq, scales, wq, ws)), torch.float32, config=config).cpu()
            assert _rel(got, ref) < KERNEL_REL


@pytest.mark.parametrize(("m", "n", "k", "split"), [(37, 150, 260, 2), (20, 300, 1024, 3), (5, 64, 128, 4),
                                                    (64, 128, 2048, 8)])
def test_triton_gemm_split_k_matches_reference(device, m, n, k, split):
    """SPLIT_K: K cut in runs of whole 128-blocks (the last one short; more splits asked than blocks: one a block),
    the partials summed by each tile's last program in split order: the same bits at every launch, and the tile
    counters back at zero after each."""
    from moeserve.kernels.triton_ops.fp8_gemm import _split_counts, fp8_gemm

    gen = torch.Generator().manual_seed(m + n + k + split)
    xq, xs = quantize_activations_reference(torch.randn(m, k, generator=gen))
    wq, ws = quantize_weight(torch.randn(n, k, generator=gen))
    ref = fp8_gemm_reference(xq, xs, wq, ws, torch.float32)
    args = [t.to(device) for t in (xq, scales_mn_major(xs), wq, ws)]
    for config in (dict(SMALL, SPLIT_K=split), dict(WIDE_N, SPLIT_K=split), dict(SMALL, SPLIT_K=split, SCALE_AHEAD=3)):
        got = fp8_gemm(*args, torch.float32, config=config)
        assert _rel(got.cpu(), ref) < KERNEL_REL
        assert torch.equal(fp8_gemm(*args, torch.float32, config=config), got)
        assert int(_split_counts(got.device).abs().sum()) == 0


_HOPPER_BUILD = """
from tests.kernels.gluon_build import compile_triton_for_hopper
from moeserve.kernels.triton_ops import fp8_gemm as ops
sig = dict(a_ptr="*fp8e4nv", as_ptr="*fp32", b_ptr="*fp8e4nv", bs_ptr="*fp32", c_ptr="*bf16", ws_ptr="*fp32",
           count_ptr="*i32")
for block_n, split, ahead in ((128, 1, 1), (256, 1, 1), (64, 2, 1), (128, 1, 3), (256, 2, 3)):
    consts = dict(BLOCK_M=64, BLOCK_N=block_n, GROUP=128, SPLIT_K=split, SCALE_AHEAD=ahead)
    ptx = compile_triton_for_hopper(ops._fp8_gemm_kernel, sig, consts, dict(num_warps=4, num_stages=3)).asm["ptx"]
    print(block_n, split, "e4m3" in ptx, "atom" in ptx)
"""


def test_triton_gemm_compiles_for_hopper():
    """The dense kernel built for sm_90 by Triton's own compiler, in a process without the interpreter (which does
    not compile): b's scale one scalar a step (128 / 64 columns) or one a column (256), split-K's counting store,
    the scales loaded after the add (SCALE_AHEAD 3).
    Triton 3.9 compiled the code after a constexpr branch's return as well, and the scalar scale's other branch
    failed there."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _HOPPER_BUILD], env=env, cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-6:-1] == ["128 1 True False", "256 1 True False", "64 2 True True",
                                             "128 1 True False", "256 2 True True"]


def test_triton_gemm_takes_the_tuned_table(device, tmp_path, monkeypatch):
    """A table for the shape (op fp8_gemm, E = 1, tune_fp8.py --dense) sets the launch; without one, 64 x 128."""
    from moeserve.kernels import moe_config
    from moeserve.kernels.triton_ops import fp8_gemm as ops

    monkeypatch.setattr(moe_config, "CONFIG_DIR", tmp_path)
    for cache in (moe_config._lookup, moe_config._load, moe_config._nearest_tuned_e):
        cache.cache_clear()
    grids = []

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]

    real = ops._fp8_gemm_kernel
    monkeypatch.setattr(ops, "_fp8_gemm_kernel", Spy())
    gen = torch.Generator().manual_seed(17)
    xq, xs = quantize_activations_reference(torch.randn(40, 256, generator=gen))
    wq, ws = quantize_weight(torch.randn(96, 256, generator=gen))
    args = [t.to(device) for t in (xq, xs, wq, ws)]
    ops.fp8_gemm(*args, torch.float32)
    path = moe_config.config_file(ops.OP, 1, 96, 256, FP8_DTYPE, moe_config.device_name())
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"1": dict(SMALL, BLOCK_N=64), "64": SMALL}))
    for cache in (moe_config._lookup, moe_config._load, moe_config._nearest_tuned_e):  # they remembered "no table"
        cache.cache_clear()
    got = ops.fp8_gemm(*args, torch.float32).cpu()
    assert grids == [(1, 1, 1), (3, 3, 1)]  # the default's 64 x 128 tiles, then the 40-row entry's 16 x 32
    assert _rel(got, fp8_gemm_reference(xq, xs, wq, ws, torch.float32)) < KERNEL_REL
    for cache in (moe_config._lookup, moe_config._load, moe_config._nearest_tuned_e):
        cache.cache_clear()


def _valid_rows(offsets: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The layout rows that hold a pair: counts[e] rows from offsets[e]."""
    valid = torch.zeros(int(offsets[-1]), dtype=torch.bool)
    for start, n in zip(offsets.tolist(), counts.tolist(), strict=False):
        valid[start:start + n] = True
    return valid


def _contiguous_inputs(counts: list[int], align: int, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    c = torch.tensor(counts, dtype=torch.int32)
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum((c + align - 1) // align * align, 0)
    xq, xs = quantize_activations_reference(torch.randn(int(offsets[-1]), k, generator=gen))
    wq, ws = quantize_weight(torch.randn(len(counts), n, k, generator=gen))
    return xq, xs, wq, ws, offsets, c


@pytest.mark.parametrize(("counts", "align", "config"), [([0, 37, 1, 0, 18], 1, SMALL), ([1], 1, SMALL),
                                                     ([5, 0, 21], 8, SMALL), ([0, 37, 1, 0, 18], 1, GROUPED_2),
                                                     ([200, 3, 0, 130], 1, None), ([0, 37, 1, 0, 18], 1, WIDE_N),
                                                     ([0, 37, 1, 0, 18], 1, dict(GROUPED_2, TILE_MAP=True)),
                                                     ([5, 0, 21], 8, dict(SMALL, TILE_MAP=True))])
@pytest.mark.parametrize("mn_major", [False, True])
def test_triton_grouped_contiguous_matches_reference(device, counts, align, config, mn_major):
    """SMALL: several tiles; GROUPED_2: row tiles in groups of 2 (partial groups at the end); None: the default
    launch configuration (64 x 128 tiles, a partial N tile; K 200 takes the pointer path); WIDE_N: a tile across two
    scale blocks of columns; TILE_MAP: the tiles read from a map built before the GEMM. mn_major: the activation scales stored [groups, rows]."""
    from moeserve.kernels.triton_ops.fp8_grouped_gemm import default_config, fp8_grouped_gemm

    args = _contiguous_inputs(counts, align, 150, 200, seed=len(counts) + align)
    if mn_major:
        args = (args[0], scales_mn_major(args[1]), *args[2:])
    ref = fp8_grouped_gemm_reference(*args, torch.float32)
    got = fp8_grouped_gemm(*(t.to(device) for t in args), torch.float32, config=config).cpu()
    wide = (config or default_config(len(args[0]), len(counts)))["BLOCK_M"] >= 64
    valid = _valid_rows(args[4], args[5])  # padding rows: the reference's zeros, the kernel's unwritten memory
    assert _rel(got[valid], ref[valid]) < (WGMMA_REL if device == "cuda" and wide else KERNEL_REL)


def test_grouped_reference_is_each_experts_gemm():
    xq, xs, wq, ws, offsets, c = _contiguous_inputs([3, 0, 5], 1, 40, 130, seed=9)
    out = fp8_grouped_gemm_reference(xq, xs, wq, ws, offsets, c, torch.float32)
    torch.testing.assert_close(out[3:8], fp8_gemm_reference(xq[3:8], xs[3:8], wq[2], ws[2], torch.float32))


def test_triton_grouped_masked_matches_reference(device):
    from moeserve.kernels.triton_ops.fp8_grouped_gemm import fp8_grouped_gemm_masked

    _check_masked(fp8_grouped_gemm_masked, device, k=200, seed=11, config=SMALL)
    _check_masked(fp8_grouped_gemm_masked, device, k=200, seed=13, config=WIDE_N, mn_major=True)


def _check_masked(kernel, device: str, k: int, seed: int, config: dict, mn_major: bool = False) -> None:
    """3 experts of capacity 40 (17, 0 and 40 rows used), N 150: the kernel's used rows against the reference."""
    gen = torch.Generator().manual_seed(seed)
    xq, xs = quantize_activations_reference(torch.randn(3, 40, k, generator=gen), mn_major)
    wq, ws = quantize_weight(torch.randn(3, 150, k, generator=gen))
    masked_m = torch.tensor([17, 0, 40], dtype=torch.int32)
    ref = fp8_grouped_gemm_masked_reference(xq, xs, wq, ws, masked_m, torch.float32)
    got = kernel(*(t.to(device) for t in (xq, xs, wq, ws, masked_m)), torch.float32, config=config).cpu()
    for i, mm in enumerate(masked_m.tolist()):
        if mm:
            assert _rel(got[i, :mm], ref[i, :mm]) < KERNEL_REL


def test_triton_grouped_tma_reads_match_reference(device):
    """The tensor-memory-accelerator variant (K a multiple of 16): a tile's rows past its expert's segment and its
    columns past N read the next expert's rows (or zeros at the ends), which the store masks."""
    from moeserve.kernels.triton_ops.fp8_grouped_gemm import (
        fp8_grouped_gemm,
        fp8_grouped_gemm_masked,
        tma_usable,
    )

    tma = dict(SMALL, TMA=True)
    args = _contiguous_inputs([0, 37, 1, 0, 18], 1, 150, 256, seed=5)
    assert tma_usable(args[0].to(device), args[2].to(device))
    ref = fp8_grouped_gemm_reference(*args, torch.float32)
    valid = _valid_rows(args[4], args[5])
    a_ptr = dict(tma, A_TMA=False)  # b through a descriptor, a by pointers (its rows past the segment not read)
    for scales, cfg in ((args[1], tma), (scales_mn_major(args[1]), tma), (args[1], dict(tma, TILE_MAP=True)),
                        (scales_mn_major(args[1]), a_ptr), (args[1], dict(tma, SCALE_AHEAD=0)),
                        (scales_mn_major(args[1]), dict(a_ptr, SCALE_AHEAD=2)),  # scales loaded 0 or 2 steps ahead
                        (args[1], dict(tma, SCALE_AHEAD=3)), (scales_mn_major(args[1]), dict(a_ptr, SCALE_AHEAD=3)),
                        (args[1], dict(tma, maxnreg=168))):  # a register cap a thread
        got = fp8_grouped_gemm(*(t.to(device) for t in (args[0], scales, *args[2:])), torch.float32, config=cfg).cpu()
        assert _rel(got[valid], ref[valid]) < KERNEL_REL
    _check_masked(fp8_grouped_gemm_masked, device, k=256, seed=12, config=tma)
    _check_masked(fp8_grouped_gemm_masked, device, k=256, seed=14, config=tma, mn_major=True)
    _check_masked(fp8_grouped_gemm_masked, device, k=256, seed=15, config=a_ptr, mn_major=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS's block-scaled FP8 GEMM needs a CUDA device")
@pytest.mark.parametrize(("m", "n", "k"), [(1, 576, 2048), (2, 576, 2048), (36, 3648, 2048), (37, 3648, 2048),
                                           (300, 2048, 1408), (64, 2048, 1000), (64, 2048, 512),
                                           (64, 2112, 7168), (256, 24576, 1536), (8, 7168, 18432), (4, 32768, 512)])
def test_cublas_backend_matches_reference(m, n, k):
    """A table entry {"backend": "cublas"}: torch._scaled_mm with DeepSeek's recipe, on either scale layout; rows
    not a multiple of 4 and K not a multiple of 512 take the Triton kernel (cuBLAS refuses the first, and sums
    wrong where a row of the weight's scales is not 16 bytes: K 1,408 and 10,944). DeepSeek-V3's linear layers
    (q_a + kv_a, q_b, the dense MLP's down, kv_b), whose tables name cuBLAS."""
    from moeserve.kernels.triton_ops.fp8_gemm import fp8_gemm

    gen = torch.Generator().manual_seed(m + n)
    xq, xs = quantize_activations_reference(torch.randn(m, k, generator=gen))
    wq, ws = quantize_weight(torch.randn(n, k, generator=gen))
    ref = fp8_gemm_reference(xq, xs, wq, ws, torch.float32)
    for scales in (xs, scales_mn_major(xs)):
        got = fp8_gemm(*(t.cuda() for t in (xq, scales, wq, ws)), torch.bfloat16, config={"backend": "cublas"})
        assert _rel(got.float().cpu(), ref) < 1e-2  # bf16 output


# The GEMMs from the activations (fp8_linear, fp8_grouped_gemm_act / _masked_act: the quantizer, then the GEMM)
# against the reference GEMM on the Triton quantizer's rows, and on the GPU against the whole reference (under the
# interpreter the quantizer carries the e4m3 rounding noted in test_triton_activation_quant_matches_reference).
def _from_activations_agree(got, quantized_ref, full_ref, cfg: dict, device: str, rows=slice(None)) -> None:
    wide = device == "cuda" and cfg["BLOCK_M"] >= 64  # the warpgroup MMA's reduced-precision sums
    assert _rel(got[rows], quantized_ref[rows]) < (WGMMA_REL if wide else KERNEL_REL)
    if device == "cuda":
        assert _rel(got[rows], full_ref()[rows]) < WGMMA_REL + KERNEL_REL


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize(("m", "n", "k"), [(37, 150, 260), (1, 64, 128), (20, 300, 256)])
def test_triton_linear_from_activations_matches_reference(device, silu, m, n, k):
    """The linear layer's GEMM from the activations (x, or silu(gate) * up of [gate | up] rows), partial groups."""
    from moeserve.kernels.fp8_gemm import fp8_linear_reference
    from moeserve.kernels.triton_ops.fp8_gemm import fp8_linear
    from moeserve.kernels.triton_ops.fp8_quant import quantize_rows

    gen = torch.Generator().manual_seed(m + n + k + silu)
    x = torch.randn(m, 2 * k if silu else k, generator=gen) * 3
    wq, ws = quantize_weight(torch.randn(n, k, generator=gen))
    dev = [t.to(device) for t in (x, wq, ws)]
    ref = fp8_gemm_reference(*(t.cpu() for t in quantize_rows(dev[0], silu, mn_major=True)), wq, ws, torch.float32)
    for cfg in (SMALL, WIDE_N):
        _from_activations_agree(fp8_linear(*dev, silu, config=cfg).cpu(), ref,
                                lambda: fp8_linear_reference(x, wq, ws, silu), cfg, device)


@pytest.mark.parametrize("silu", [False, True])
def test_triton_grouped_from_activations_matches_reference(device, silu):
    """The experts' GEMMs from the activations: gate/up's rows gathered from the tokens (a padding pair -1 inside a
    segment: a row of zeros), down's rows silu(gate) * up; contiguous and masked layouts, 16- and 64-row tiles."""
    from moeserve.kernels import fp8_grouped_gemm as ref
    from moeserve.kernels.triton_ops.fp8_grouped_gemm import fp8_grouped_gemm_act, fp8_grouped_gemm_masked_act
    from moeserve.kernels.triton_ops.fp8_quant import quantize_rows

    gen = torch.Generator().manual_seed(31 + silu)
    counts = torch.tensor([0, 37, 1, 0, 18], dtype=torch.int32)
    offsets = torch.zeros(6, dtype=torch.int32)
    offsets[1:] = torch.cumsum(counts, 0)
    k, top_k = 256, 3
    wq, ws = quantize_weight(torch.randn(5, 150, k, generator=gen))
    if silu:
        x, pairs = torch.randn(56, 2 * k, generator=gen), None
    else:
        x, pairs = torch.randn(30, k, generator=gen), torch.randint(0, 90, (56,), generator=gen, dtype=torch.int32)
        pairs[5] = -1
    valid = _valid_rows(offsets, counts)
    masked_m = torch.tensor([17, 0, 40, 3, 1], dtype=torch.int32)
    xm = torch.randn(5, 40, 2 * k if silu else k, generator=gen)
    keep = torch.arange(40)[None, :] < masked_m[:, None]
    d = lambda *ts: [None if t is None else t.to(device) for t in ts]  # noqa: E731
    q_rows = [t.cpu() for t in quantize_rows(*d(x), silu, mn_major=True, pairs=d(pairs)[0], top_k=top_k)]
    q_rows_m = [t.cpu() for t in quantize_rows(*d(xm), silu, mn_major=True)]
    quantized = ref.fp8_grouped_gemm_reference(*q_rows, wq, ws, offsets, counts, torch.float32)
    quantized_m = ref.fp8_grouped_gemm_masked_reference(*q_rows_m, wq, ws, masked_m, torch.float32)
    for cfg in (dict(SMALL, TMA=True), dict(SMALL, TMA=True, BLOCK_M=64, BLOCK_N=128, GROUP_M=2)):
        got = fp8_grouped_gemm_act(*d(x, wq, ws, offsets, counts), torch.float32, *d(pairs), top_k, silu, cfg).cpu()
        _from_activations_agree(
            got, quantized,
            lambda: ref.fp8_grouped_gemm_act(x, wq, ws, offsets, counts, torch.float32, pairs, top_k, silu),
            cfg, device, valid)
        if not silu:
            assert (got[5] == 0).all()  # the padding pair
        _from_activations_agree(
            fp8_grouped_gemm_masked_act(*d(xm, wq, ws, masked_m), torch.float32, silu, cfg).cpu(), quantized_m,
            lambda: ref.fp8_grouped_gemm_masked_act(xm, wq, ws, masked_m, torch.float32, silu), cfg, device, keep)
