"""The Gluon bf16 grouped GEMM (triton_ops/moe_gemm_wgmma.py). Gluon has no interpreter: on CPU each form is compiled
for an sm_90 GPU (Triton's own compiler and ptxas, no device needed), which checks that it builds warp-specialized,
with one K step's MMAs kept in flight, without spills or serialized MMAs; on a GPU each form runs against the torch
reference in both layouts, with the rows in place and gathered by pairs (padding rows among them), with and without
SiLU, over ragged experts (empty ones, a single row, partial tiles)."""

from __future__ import annotations

import re

import pytest
import torch

from moeserve.kernels.moe_gemm import moe_gemm_masked_reference, moe_gemm_reference
from tests.kernels.gluon_build import compile_for_hopper, ptxas_report

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper", reason="Triton without Gluon")

FORMS = [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4, GROUP_M=8, TILE_MAP=True),
         dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=6, GROUP_M=16),
         dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=4, num_stages=4, GROUP_M=8, TILE_MAP=True)]
# (form, silu, gather, masked) as the runtime calls them: gate/up gathers its rows, down reads them in place
CASES = [(0, True, True, False), (1, True, True, False), (0, False, False, False), (2, False, False, False),
         (1, True, False, True), (0, False, False, True)]


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


def _compile(cfg: dict, silu: bool, gather: bool, masked: bool):
    from triton.experimental.gluon import language as gl

    from moeserve.kernels.triton_ops import moe_gemm_wgmma as g

    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    lb = gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16)
    la = lb if gather else gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16)
    sig = dict(a_desc=f"tensordesc<bf16[{bn if gather else bm}, {bk}],{la!r}>", a_ptr="*bf16",
               b_desc=f"tensordesc<bf16[{bn}, {bk}],{lb!r}>", c_ptr="*bf16", starts_ptr="*i32", counts_ptr="*i32",
               pairs_ptr="*i32", map_ptr="*i32")
    consts = dict(E=64, E_P2=64, MASKED=masked, TILE_MAP=bool(cfg.get("TILE_MAP")) and not masked, SILU=silu,
                  GATHER=gather, TOPK=6, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"],
                  STAGES=cfg["num_stages"], num_warps=cfg["num_warps"])
    return compile_for_hopper(g._moe_gemm_wgmma_kernel, sig, consts,
                              divisible=("a_ptr", "c_ptr", "stride_am", "stride_cm", "N", "K"))


@pytest.mark.parametrize("case", CASES)
def test_compiles_for_hopper_warp_specialized(case, tmp_path):
    """Each form builds for sm_90 as three partitions (registers moved between them with setmaxnreg), one step's MMAs
    in flight (wait_group 1, 2 with SiLU's two products), the gathered rows copied by cp.async onto the ready
    barrier, without spills, and without ptxas serializing its MMAs (warning C7514)."""
    form, silu, gather, masked = case
    ptx = _compile(FORMS[form], silu, gather, masked).asm["ptx"]
    assert "wgmma.mma_async" in ptx and ".bf16" in ptx and "setmaxnreg" in ptx
    assert set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx)) == {"0", "2" if silu else "1"}
    assert ("cp.async.mbarrier.arrive.noinc" in ptx) == gather
    info = ptxas_report(ptx, tmp_path)
    assert "C7514" not in info and " 0 bytes spill stores" in info, info


def test_usable_refuses_what_it_does_not_take():
    from moeserve.kernels.triton_ops.moe_gemm_wgmma import usable

    a, w = torch.empty(10, 256, dtype=torch.bfloat16), torch.empty(4, 512, 256, dtype=torch.bfloat16)
    assert usable(a, w, FORMS[0], silu=True, gather=True, masked=False)
    assert not usable(a, w, FORMS[2], silu=True, gather=False, masked=False)  # 256 wide with SiLU: two 64x256 sums
    assert not usable(a.float(), w.float(), FORMS[0], silu=False, gather=False, masked=False)
    assert not usable(a[:, :200], w[:, :, :200], FORMS[0], silu=False, gather=False, masked=False)  # K % 64
    assert not usable(a, w, dict(FORMS[0], BLOCK_M=64), silu=False, gather=False, masked=False)
    assert not usable(a, w, FORMS[0], silu=False, gather=True, masked=True)
    wide = torch.empty(10, 264, dtype=torch.bfloat16)[:, :256]  # rows 264 apart: 16 bytes, not 16 elements
    assert usable(wide, w, FORMS[0], silu=True, gather=False, masked=False)
    assert not usable(wide, w, FORMS[0], silu=True, gather=True, masked=False)


cuda = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                          reason="the warpgroup MMA needs a Hopper-class GPU")


def _layout(counts: list[int], tokens: int, top_k: int, gen: torch.Generator):
    """offsets / counts of the experts' segments and pairs naming each row's token (token * top_k + slot), a few
    of them -1 (padding rows)."""
    c = torch.tensor(counts, dtype=torch.int32)
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(c, 0)
    m = int(offsets[-1])
    pairs = torch.randint(0, tokens * top_k, (m,), generator=gen, dtype=torch.int32)
    pairs[torch.rand(m, generator=gen) < 0.05] = -1
    return offsets, c, pairs


@cuda
@pytest.mark.parametrize("case", [c for c in CASES if not c[3]])
@pytest.mark.parametrize("counts", [[0, 37, 1, 0, 200], [1], [130, 64, 0, 3, 256, 129]])
def test_contiguous_matches_reference(case, counts):
    from moeserve.kernels.triton_ops.moe_gemm import _wgmma_usable, moe_gemm

    form, silu, gather, _ = case
    cfg = dict(FORMS[form], WGMMA=True)
    gen = torch.Generator().manual_seed(len(counts) + form)
    top_k, k, n = 3, 384, 256 if FORMS[form]["BLOCK_N"] <= 128 else 512
    offsets, c, pairs = _layout(counts, 97, top_k, gen)
    x = torch.randn(97 if gather else int(offsets[-1]), k, generator=gen).bfloat16()
    w = (torch.randn(len(counts), 2 * n if silu else n, k, generator=gen) * k**-0.5).bfloat16()
    p = pairs if gather else None
    tally = torch.arange(len(counts), dtype=torch.int64)
    ref = moe_gemm_reference(x.float(), w.float(), offsets, c, silu, p, top_k)
    dev = [t.cuda() for t in (x, w, offsets, c)]
    assert _wgmma_usable(dev[0], dev[1], cfg, silu, gather, False)
    t_dev = tally.cuda()
    got = moe_gemm(*dev, silu, cfg, pairs=None if p is None else p.cuda(), top_k=top_k, tally=t_dev).float().cpu()
    assert torch.equal(t_dev.cpu(), tally + c)
    valid = torch.cat([torch.arange(int(o), int(o) + int(m)) for o, m in zip(offsets[:-1], c, strict=True)])
    assert _rel(got[valid], ref[valid]) < 1e-2  # bf16 operands and output


@cuda
@pytest.mark.parametrize("case", [c for c in CASES if c[3]])
def test_masked_matches_reference(case):
    from moeserve.kernels.triton_ops.moe_gemm import moe_gemm_masked

    form, silu, _, _ = case
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(3, 140, 512, generator=gen).bfloat16()
    w = (torch.randn(3, 512 if silu else 256, 512, generator=gen) * 512**-0.5).bfloat16()
    masked_m = torch.tensor([17, 0, 140], dtype=torch.int32)
    ref = moe_gemm_masked_reference(x.float(), w.float(), masked_m, silu)
    got = moe_gemm_masked(*(t.cuda() for t in (x, w, masked_m)), silu, config=dict(FORMS[form], WGMMA=True))
    got = got.float().cpu()
    for i, mm in enumerate(masked_m.tolist()):
        if mm:
            assert _rel(got[i, :mm], ref[i, :mm]) < 1e-2


@cuda
def test_prefill_size_agrees_with_the_triton_kernel():
    """V2-Lite's gate/up at a prefill-like size, rows gathered: the Gluon kernel against the Triton kernel on the
    same inputs (fp32 accumulation in both)."""
    from moeserve.kernels.triton_ops.moe_gemm import moe_gemm

    gen = torch.Generator().manual_seed(5)
    counts = torch.randint(0, 400, (64,), generator=gen).tolist()
    offsets, c, pairs = _layout(counts, 4096, 6, gen)
    x = torch.randn(4096, 2048, generator=gen).bfloat16().cuda()
    w = (torch.randn(64, 2816, 2048, generator=gen) * 2048**-0.5).bfloat16().cuda()
    args = (x, w, offsets.cuda(), c.cuda(), True)
    a = moe_gemm(*args, dict(FORMS[0], WGMMA=True), pairs=pairs.cuda(), top_k=6).float()
    b = moe_gemm(*args, dict(FORMS[0], num_warps=8, TMA=True), pairs=pairs.cuda(), top_k=6).float()
    valid = torch.cat([torch.arange(int(o), int(o) + int(m)) for o, m in zip(offsets[:-1], c, strict=True)]).cuda()
    assert _rel(a[valid], b[valid]) < 1e-2


@cuda
def test_v2_lite_prefill_through_the_shipped_tables():
    """V2-Lite's two expert GEMMs at a 4 x 2,048 prefill through the public entry (kernels/moe_gemm.py) and the
    shipped tables (on an H200: the Gluon kernel), against the reference (torch's grouped GEMM) on the same rows."""
    from moeserve.kernels.moe_gemm import moe_gemm as public_moe_gemm
    from moeserve.kernels.moe_route import moe_route

    E, top_k, H, inter, T = 64, 6, 2048, 1408, 8192
    gen = torch.Generator(device="cuda").manual_seed(8)
    ids = torch.rand(T, E, generator=gen, device="cuda").topk(top_k, dim=1).indices
    plan = moe_route(ids, E, all_valid=True)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    w13 = (torch.randn(E, 2 * inter, H, device="cuda", generator=gen) * H**-0.5).bfloat16()
    w2 = (torch.randn(E, H, inter, device="cuda", generator=gen) * inter**-0.5).bfloat16()
    h = public_moe_gemm(x, w13, plan.offsets, plan.counts, silu=True, pairs=plan.src, top_k=top_k)
    h_ref = moe_gemm_reference(x, w13, plan.offsets, plan.counts, True, plan.src, top_k)
    assert _rel(h.float(), h_ref.float()) < 1e-2
    y = public_moe_gemm(h_ref, w2, plan.offsets, plan.counts)
    assert _rel(y.float(), moe_gemm_reference(h_ref, w2, plan.offsets, plan.counts).float()) < 1e-2
