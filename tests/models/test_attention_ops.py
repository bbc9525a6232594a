"""The reference attention ops against a naive softmax(q k^T) v, on ragged batches over a shuffled cache."""

from __future__ import annotations

import pytest
import torch

from moeserve.layers.attention import extend_plan
from moeserve.layers.attention.extend_plan import ExtendPlan
from moeserve.layers.attention.ops import decode_attention, extend_attention, padded_kv_slots

GEN = torch.Generator().manual_seed(0)


def _naive(q, k, v, q_pos, scale, window=None):
    """q [n, Hq, D] at positions q_pos over k, v [s, Hkv, D] (positions 0..s-1)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    kp = torch.arange(k.shape[0])[None, :]
    mask = kp <= q_pos[:, None]
    if window is not None:
        mask &= kp > q_pos[:, None] - window
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("window", [None, 3])
def test_extend_ragged(hq, hkv, window):
    seq_lens, ext = [5, 9, 1, 4], [5, 3, 1, 4]
    D, Dv = 16, 8
    q = torch.randn(sum(ext), hq, D, generator=GEN)
    k = torch.randn(sum(seq_lens), hkv, D, generator=GEN)
    v = torch.randn(sum(seq_lens), hkv, Dv, generator=GEN)
    out = extend_attention(q, k, v, ext, seq_lens, 0.3, window)
    qs = ks = 0
    for s, n in zip(seq_lens, ext, strict=True):
        ref = _naive(q[qs:qs + n], k[ks:ks + s], v[ks:ks + s], torch.arange(s - n, s), 0.3, window)
        torch.testing.assert_close(out[qs:qs + n], ref, atol=1e-5, rtol=1e-5)
        qs, ks = qs + n, ks + s


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 4])
def test_decode_padded(hq, hkv, window):
    seq_lens = [3, 10, 1, 6]
    D, Dv, num_slots = 16, 12, 64
    k_cache = torch.randn(num_slots, hkv, D, generator=GEN)
    v_cache = torch.randn(num_slots, hkv, Dv, generator=GEN)
    perm = (torch.randperm(num_slots - 1, generator=GEN) + 1)[: sum(seq_lens)]
    kv_indptr = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()])
    slots, mask = padded_kv_slots(perm, kv_indptr, torch.tensor(seq_lens), max(seq_lens))
    q = torch.randn(len(seq_lens), hq, D, generator=GEN)
    out = decode_attention(q, k_cache, v_cache, slots, mask, 0.25, window)
    for b, s in enumerate(seq_lens):
        idx = perm[kv_indptr[b]:kv_indptr[b + 1]]
        ref = _naive(q[b:b + 1], k_cache[idx], v_cache[idx], torch.tensor([s - 1]), 0.25, window)
        torch.testing.assert_close(out[b:b + 1], ref, atol=1e-5, rtol=1e-5)


def test_decode_value_inside_key():
    """MLA: the value is the first Dv dims of the (single-head) key."""
    cache = torch.randn(32, 1, 20, generator=GEN)
    seq_lens = [4, 7]
    idx = torch.randperm(31, generator=GEN)[:11] + 1
    kv_indptr = torch.tensor([0, 4, 11])
    slots, mask = padded_kv_slots(idx, kv_indptr, torch.tensor(seq_lens), 7)
    q = torch.randn(2, 8, 20, generator=GEN)
    torch.testing.assert_close(decode_attention(q, cache, 16, slots, mask, 0.2),
                               decode_attention(q, cache, cache[..., :16], slots, mask, 0.2))


def _check_extend(ext, seq_lens, hq, hkv, window, D=16, Dv=8, device="cpu", dtype=torch.float64, tol=1e-9):
    """Batched extend attention against the float64 naive reference, request by request (the reference sees the
    inputs as rounded to `dtype`, so only the kernel's own rounding is measured)."""
    def rand(*shape):
        return torch.randn(*shape, generator=GEN, dtype=torch.float64).to(dtype).double()

    q, k, v = rand(sum(ext), hq, D), rand(sum(seq_lens), hkv, D), rand(sum(seq_lens), hkv, Dv)
    scale = D**-0.5
    out = extend_attention(q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), ext, seq_lens, scale,
                           window)
    qs = ks = 0
    for s, n in zip(seq_lens, ext, strict=True):
        ref = _naive(q[qs:qs + n], k[ks:ks + s], v[ks:ks + s], torch.arange(s - n, s), scale, window)
        torch.testing.assert_close(out[qs:qs + n].cpu().double(), ref, atol=tol, rtol=tol)
        qs, ks = qs + n, ks + s


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("small_area,num_groups", [(0, 3), (1 << 20, 1)])
def test_extend_mixed_lengths_and_prefixes(window, small_area, num_groups, monkeypatch):
    """Fresh prompts beside prefix hits and chunk continuations, one long request among short ones, requests with
    nothing new, equal-length runs; split into groups by the padding budget alone (small_area 0) or all in one."""
    monkeypatch.setattr(extend_plan, "SMALL_AREA", small_area)
    ext = [40, 3, 7, 0, 7, 7, 1, 12, 5, 5]
    seq_lens = [200, 3, 19, 4, 7, 7, 30, 12, 5, 5]
    plan = ExtendPlan.build(ext, seq_lens, "cpu")
    assert len(plan.groups) == num_groups and plan.num_tokens == sum(ext)
    _check_extend(ext, seq_lens, 4, 2, window)


def test_extend_plan_groups():
    # all equal, no prefix: one dense group, a view of q/k/v with no mask
    (g,) = ExtendPlan.build([128] * 64, [128] * 64, "cpu").groups
    assert g.q_rows == (0, 128 * 64) and g.mask(None) is None and g.mask(4) is not None
    # a 4000-token prompt beside 60 short ones: the short ones are not padded to 4000 (one may join within the
    # padding budget)
    groups = ExtendPlan.build([4000] + [60] * 60, [4000] + [60] * 60, "cpu").groups
    assert len(groups) == 2 and groups[1].lk == 60 and groups[1].batch >= 59
    # ragged prompts without prefixes: causal without a mask
    (g,) = ExtendPlan.build([5, 9, 2], [5, 9, 2], "cpu").groups
    assert g.causal and g.mask(None) is None


def test_extend_all_equal_prefix_and_fresh():
    _check_extend([16] * 6, [16] * 6, 4, 4, None)  # the dense path
    _check_extend([4] * 6, [20] * 6, 4, 1, None)  # equal chunks over equal prefixes: masked


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_extend_cuda_mla_shapes(dtype):
    """On CUDA at MLA's head sizes (q/k 192, v 128: FLASH refuses them), with and without prefixes, and GQA with
    a sliding window."""
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    _check_extend([128] * 4, [128] * 4, 16, 16, None, D=192, Dv=128, device="cuda", dtype=dtype, tol=tol)
    _check_extend([300, 17, 64, 64, 1], [300, 90, 64, 200, 33], 16, 16, None, D=192, Dv=128, device="cuda",
                  dtype=dtype, tol=tol)
    _check_extend([70, 9, 33], [70, 40, 33], 8, 2, 16, D=64, Dv=64, device="cuda", dtype=dtype, tol=tol)
