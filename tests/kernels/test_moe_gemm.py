"""The Triton MoE grouped GEMM (both layouts, with and without SiLU fused) against its torch reference."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.moe_gemm import moe_gemm_masked_reference, moe_gemm_reference

SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=2)  # several tiles on tiny shapes
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


def _check_rows(got, ref, counts, offsets, dtype):
    # rows outside the counts are unspecified: compare the counted rows only
    rows = torch.cat([torch.arange(int(offsets[e]), int(offsets[e]) + int(c)) for e, c in enumerate(counts)])
    assert _rel_err(got[rows.to(got.device)], ref[rows.to(ref.device)]) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("counts,align", [([0, 37, 1, 0, 18], 1), ([1], 1), ([5, 0, 21], 8)])
def test_contiguous_matches_reference(dtype, silu, counts, align, device):
    from moeserve.kernels.triton_ops.moe_gemm import moe_gemm

    gen = torch.Generator().manual_seed(len(counts) * 7 + align + silu)
    E, K, N = len(counts), 40, 2 * 24  # K, N not multiples of the 16-wide blocks' 32 or 64
    c = torch.tensor(counts, dtype=torch.int32)
    padded = (c + align - 1) // align * align
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(padded, 0)
    x = torch.randn(int(offsets[-1]), K, generator=gen).to(dtype)
    w = (torch.randn(E, N, K, generator=gen) * K**-0.5).to(dtype)
    ref = moe_gemm_reference(x.float(), w.float(), offsets, c, silu)
    args = [t.to(device) for t in (x, w, offsets, c)]
    got = moe_gemm(*args, silu=silu, config=SMALL).cpu()
    _check_rows(got, ref, counts, offsets, dtype)
    got = moe_gemm(*args, silu=silu, config={**SMALL, "GROUP_M": 3}).cpu()  # grouped-M order, pointer reads
    _check_rows(got, ref, counts, offsets, dtype)
    got = moe_gemm(*args, silu=silu, config={**SMALL, "GROUP_M": 3, "TILE_MAP": True}).cpu()  # tiles from a map
    _check_rows(got, ref, counts, offsets, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("align", [1, 8])
def test_contiguous_gathers_named_rows(dtype, align, device):
    """pairs (moe_route's src): the kernel reads each row from the tokens; the same as on the gathered copy."""
    from moeserve.kernels.moe_route import moe_route_reference
    from moeserve.kernels.triton_ops.moe_gemm import moe_gemm

    gen = torch.Generator().manual_seed(11 + align)
    T, k, E, K, N = 13, 3, 5, 40, 2 * 24
    ids = torch.randint(0, E, (T, k), generator=gen)
    ids[2] = 4  # one expert takes many pairs, one none
    ids[ids == 1] = 0
    plan = moe_route_reference(ids, E, align)
    tokens = torch.randn(T, K, generator=gen).to(dtype)
    w = (torch.randn(E, N, K, generator=gen) * K**-0.5).to(dtype)
    ref = moe_gemm_reference(tokens.float(), w.float(), plan.offsets, plan.counts, True, pairs=plan.src, top_k=k)
    got = moe_gemm(tokens.to(device), w.to(device), plan.offsets.to(device), plan.counts.to(device), silu=True,
                   config=SMALL, pairs=plan.src.to(device), top_k=k).cpu()
    assert got.shape == ref.shape == (plan.num_rows, N // 2)
    _check_rows(got, ref, plan.counts.tolist(), plan.offsets, dtype)
    # and the reference's gather is the copy the layout used to hold
    src = plan.src.long()
    rows = tokens.float().index_select(0, src.clamp(min=0) // k).masked_fill_((src < 0)[:, None], 0)
    copied = moe_gemm_reference(rows, w.float(), plan.offsets, plan.counts, True)
    _check_rows(ref, copied, plan.counts.tolist(), plan.offsets, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("group_m", [0, 2])
def test_tensor_descriptor_reads(dtype, silu, gather, group_m, device):
    """"TMA": w (and a, where its rows are not gathered) read through tensor descriptors: tiles that run past an
    expert's rows, past N into the up half or the next expert, and past K, all masked at the store."""
    from moeserve.kernels.moe_route import moe_route_reference
    from moeserve.kernels.triton_ops.moe_gemm import moe_gemm

    gen = torch.Generator().manual_seed(21 + silu + 2 * gather)
    T, k, E, K, N = 29, 2, 4, 40, 2 * 24  # K: 2.5 steps of 16; N: one and a half 16-wide tiles per half
    ids = torch.rand(T, E, generator=gen).topk(k, dim=1).indices
    plan = moe_route_reference(ids, E, 1)
    tokens = torch.randn(T, K, generator=gen).to(dtype)
    rows = tokens.index_select(0, plan.src.long() // k)  # the layout's rows, for the ungathered GEMM
    w = (torch.randn(E, N, K, generator=gen) * K**-0.5).to(dtype)
    cfg = {**SMALL, "TMA": True, "GROUP_M": group_m}  # GROUP_M 2: a 1-D grid in grouped-M order
    cfg["TILE_MAP"] = bool(group_m)  # (and the tiles read from a map)
    x, pairs = (tokens, plan.src) if gather else (rows, None)
    ref = moe_gemm_reference(x.float(), w.float(), plan.offsets, plan.counts, silu, pairs=pairs, top_k=k)
    got = moe_gemm(x.to(device), w.to(device), plan.offsets.to(device), plan.counts.to(device), silu=silu,
                   config=cfg, pairs=None if pairs is None else pairs.to(device), top_k=k).cpu()
    _check_rows(got, ref, plan.counts.tolist(), plan.offsets, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("tma", [False, True])
def test_masked_matches_reference(dtype, silu, tma, device):
    from moeserve.kernels.triton_ops.moe_gemm import moe_gemm_masked

    gen = torch.Generator().manual_seed(3 + silu)
    E, C, K, N = 4, 19, 24, 2 * 20
    masked_m = torch.tensor([0, 19, 1, 7], dtype=torch.int32)
    x = torch.randn(E, C, K, generator=gen).to(dtype)
    w = (torch.randn(E, N, K, generator=gen) * K**-0.5).to(dtype)
    ref = moe_gemm_masked_reference(x.float(), w.float(), masked_m, silu)
    cfg = {**SMALL, "TMA": tma}  # (TMA: w through a descriptor; the rows, in [E, C] slots, by pointers)
    got = moe_gemm_masked(x.to(device), w.to(device), masked_m.to(device), silu, config=cfg).cpu()
    for e, m in enumerate(masked_m.tolist()):
        if m:
            assert _rel_err(got[e, :m], ref[e, :m]) < TOL[dtype]


def test_default_configs_cover_decode_and_prefill_shapes(device):
    """The launch configurations the serving path uses (tables or defaults), on a tiny shape."""
    from moeserve.kernels.triton_ops.moe_gemm import moe_gemm

    gen = torch.Generator().manual_seed(11)
    counts = torch.tensor([3, 0, 140], dtype=torch.int32)
    offsets = torch.tensor([0, 3, 3, 143], dtype=torch.int32)
    x = torch.randn(143, 32, generator=gen)
    w = torch.randn(3, 32, 32, generator=gen) * 32**-0.5
    got = moe_gemm(x.to(device), w.to(device), offsets.to(device), counts.to(device), silu=True).cpu()
    _check_rows(got, moe_gemm_reference(x, w, offsets, counts, True), [3, 0, 140], offsets, torch.float32)


@pytest.mark.parametrize("masked", [False, True])
def test_tally_adds_the_first_counts(masked, device):
    """tally: the first n experts' counts are added into the int64 counter, by the kernel's first program (and by
    the reference), on top of what it held; the products are unchanged."""
    from moeserve.kernels.triton_ops.moe_gemm import moe_gemm, moe_gemm_masked

    gen = torch.Generator().manual_seed(5 + masked)
    counts = torch.tensor([3, 0, 9, 2], dtype=torch.int32)
    w = torch.randn(4, 32, 24, generator=gen) * 24**-0.5
    start = torch.tensor([5, 1, 0], dtype=torch.int64)  # three local experts of four slots (a fused one last)
    tally, ref_tally = start.clone().to(device), start.clone()
    if masked:
        x = torch.randn(4, 9, 24, generator=gen)
        got = moe_gemm_masked(x.to(device), w.to(device), counts.to(device), True, config=SMALL, tally=tally)
        ref = moe_gemm_masked_reference(x, w, counts, True, tally=ref_tally)
        for e, m in enumerate(counts.tolist()):
            if m:
                assert _rel_err(got[e, :m].cpu(), ref[e, :m]) < TOL[torch.float32]
    else:
        offsets = torch.tensor([0, 3, 3, 12, 14], dtype=torch.int32)
        x = torch.randn(14, 24, generator=gen)
        got = moe_gemm(x.to(device), w.to(device), offsets.to(device), counts.to(device), True, config=SMALL,
                       tally=tally)
        ref = moe_gemm_reference(x, w, offsets, counts, True, tally=ref_tally)
        _check_rows(got.cpu(), ref, counts.tolist(), offsets, torch.float32)
    assert tally.cpu().tolist() == ref_tally.tolist() == [8, 1, 9]
    # no rows at all: no program runs, and the tally is left as it was
    empty = torch.zeros(0, 24)
    moe_gemm(empty.to(device), w.to(device), torch.zeros(5, dtype=torch.int32, device=device),
             torch.zeros(4, dtype=torch.int32, device=device), True, config=SMALL, tally=tally)
    assert tally.cpu().tolist() == [8, 1, 9]


@pytest.mark.parametrize("counts,block_m", [([0, 37, 1, 0, 18], 16), ([1], 64), ([64, 64, 0], 64), ([0, 0], 16),
                                            ([3] * 70, 16)])
def test_tile_map_lists_every_tile_in_order(counts, block_m, device):
    """tile_map against the tiles counted on the host: each expert's row tiles in turn, rows left in the segment,
    then zeros for the grid's spare programs (the static bound cdiv(M, BLOCK_M) + min(E, M))."""
    import triton

    from moeserve.kernels.triton_ops.tile_order import tile_map

    c = torch.tensor(counts, dtype=torch.int32)
    starts = torch.zeros(len(counts) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(c, 0)
    rows = int(starts[-1])
    num_m = triton.cdiv(rows, block_m) + min(len(counts), rows)
    want = [(e, int(starts[e]) + t * block_m, n - t * block_m)
            for e, n in enumerate(counts) for t in range(triton.cdiv(n, block_m))]
    if num_m == 0:
        return
    got = tile_map(starts.to(device), c.to(device), num_m, block_m).cpu()
    assert got.shape == (3, num_m)
    assert [tuple(t) for t in got[:, :len(want)].t().tolist()] == want
    assert (got[2, len(want):] == 0).all()  # spare programs: nothing to do


@pytest.mark.parametrize("counts,block_m", [([0, 37, 1, 0, 18], 16), ([1], 64), ([64, 64, 0], 64), ([0, 0], 16),
                                            ([3] * 70, 16), ([5] * 64 + [256, 256], 64)])
def test_expert_tile_runs_every_tile_once(counts, block_m, device):
    """expert_tile's contiguous lookup over the grid's static bound: each expert's row tiles once, in order, then
    nothing for the spare programs. (The spare programs once took their tile counted from the end, and those below
    the last expert's own tile count redid its first tiles: equal values written twice, weights read twice.)"""
    import triton

    from tests.kernels.tile_lookup import lookup_kernel

    c = torch.tensor(counts, dtype=torch.int32)
    starts = torch.zeros(len(counts) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(c, 0)
    rows = int(starts[-1])
    num_m = triton.cdiv(rows, block_m) + min(len(counts), rows)
    if num_m == 0:
        return
    want = [(e, int(starts[e]) + t * block_m, n - t * block_m)
            for e, n in enumerate(counts) for t in range(triton.cdiv(n, block_m))]
    out = torch.full((num_m, 3), -7, dtype=torch.int32, device=device)
    lookup_kernel[(num_m,)](starts.to(device), c.to(device), out, E=len(counts),
                            E_P2=triton.next_power_of_2(len(counts)), BLOCK_M=block_m)
    got = out.cpu()
    assert [tuple(t) for t in got[:len(want)].tolist()] == want
    assert (got[len(want):, 2] == 0).all(), got[len(want):].tolist()  # spare programs: nothing to do
