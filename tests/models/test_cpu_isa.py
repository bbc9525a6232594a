"""Every ISA build of the C++ CPU kernels (--cpu-isa amx, avx512, avx2; kernels/cpu_isa.py) against float64
references, in bf16 and float32: the experts kernel on ragged loads with empty experts, the one-call MoE with
tokens routed nowhere, MLA decode over the paged latent cache, RMSNorm, the bf16 skinny GEMM of 1 to 4 rows and its batched
form, MLA's latent write (norm, rotary, cache rows). A path the CPU lacks is skipped, saying why."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from moeserve.args import ServerArgs
from moeserve.kernels import (
    build,
    cpu_experts,
    cpu_isa,
    cpu_mla_decode,
    cpu_mla_rope_cache,
    cpu_rms_norm,
    cpu_skinny_gemm,
    mla_rope_cache,
    rms_norm,
    skinny_gemm,
)
from moeserve.layers.moe.experts import Experts

pytestmark = pytest.mark.skipif(cpu_experts.load() is None, reason="no C++ compiler: the kernels cannot build")


BF16_DOT = ("amx", "avx512bf16")  # the builds with AVX-512 BF16: packed bf16 experts, bf16 dot products


@pytest.fixture
def one_thread():
    """torch on one thread for the test (the packed products' large shapes run only there), then back."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _weights(gen, E, H, inter, dtype):
    """w13 [E, 2I, H], w2 [E, H, I] stored transposed (as Experts keeps them on the CPU), unit output scale."""
    w13 = (torch.randn(E, 2 * inter, H, generator=gen) * H**-0.5).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=gen) * inter**-0.5).to(dtype)
    return tuple(w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w13, w2))


def _expert(x, w13, w2, e):
    """One expert on rows x, in float64."""
    h = x.double() @ w13[e].double().T
    inter = w13.shape[1] // 2
    return (F.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].double().T


def _tol(dtype):
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(3))
def test_experts_on_ragged_loads(isa, dtype, seed):
    """Random widths (multiples of 32 so that AMX runs them, and some that are not), 0-40 rows per expert."""
    gen = torch.Generator().manual_seed(10 * seed + len(isa))
    E = int(torch.randint(2, 9, (1,), generator=gen))
    H, inter = [(64, 32), (256, 128), (96, 160), (72, 40)][seed if dtype == torch.float32 else seed + 1]
    w13, w2 = _weights(gen, E, H, inter, dtype)
    counts = torch.randint(0, 41, (E,), generator=gen)
    counts[int(torch.randint(0, E, (1,), generator=gen))] = 0  # an expert nobody picked
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = counts.cumsum(0)
    x = torch.randn(int(offsets[-1]), H, generator=gen).to(dtype)
    packed = cpu_experts.pack(w13, w2)
    assert (packed is not None) == (isa in BF16_DOT and dtype == torch.bfloat16 and H % 32 == 0 and inter % 32 == 0)
    got = cpu_experts.cpu_experts(x, w13, w2, offsets, counts.int(), packed)
    for e in range(E):
        rows = slice(int(offsets[e]), int(offsets[e + 1]))
        torch.testing.assert_close(got[rows].double(), _expert(x[rows], w13, w2, e), **_tol(dtype))


@pytest.mark.parametrize("tile_from", [1, 5, 17, 1000])
def test_packed_experts_tiles_and_dot_products_agree(isa, tile_from, monkeypatch):
    """Where an expert's rows switch from AMX tiles to dot products (cpu_experts.TILE_FROM_ROWS): every switch
    point gives the float64 result, segments of 1 to 40 rows (tiles of 16 with the rest as dot products, 6 rows a
    pass). In the avx512bf16 build the rows run as dot products whatever the switch point."""
    if isa not in BF16_DOT:
        pytest.skip(f"the {isa} build has no packed bf16 experts")
    monkeypatch.setattr(cpu_experts, "TILE_FROM_ROWS", tile_from)
    gen = torch.Generator().manual_seed(tile_from + len(isa))
    E, H, inter = 6, 128, 96
    w13, w2 = _weights(gen, E, H, inter, torch.bfloat16)
    counts = torch.tensor([1, 40, 0, 17, 6, 23], dtype=torch.int32)
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = counts.cumsum(0)
    x = torch.randn(int(offsets[-1]), H, generator=gen).bfloat16()
    got = cpu_experts.cpu_experts(x, w13, w2, offsets, counts, cpu_experts.pack(w13, w2))
    for e in range(E):
        rows = slice(int(offsets[e]), int(offsets[e + 1]))
        torch.testing.assert_close(got[rows].double(), _expert(x[rows], w13, w2, e), **_tol(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 7, 64, 200])
def test_moe_local_with_tokens_routed_nowhere(isa, dtype, T):
    """The one-call MoE (grouping, experts, weighted sum): top-4 of 16 experts with some tokens' weights all
    zero and a skewed load (half the pairs on two experts). At 200 tokens two experts get over 100 rows: a
    prefill's counts, which the packed kernel takes (kernel_takes)."""
    gen = torch.Generator().manual_seed(T + len(isa))
    E, H, inter, k = 16, 256, 128, 4
    w13, w2 = _weights(gen, E, H, inter, dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    ids[: T // 2, :2] = torch.tensor([3, 9])
    weights = torch.rand(T, k, generator=gen)
    weights[::3] = 0.0  # routed nowhere: their output is zero
    x = torch.randn(T, H, generator=gen).to(dtype)
    got, counts = cpu_experts.cpu_moe_local(x, ids, weights, w13, w2, cpu_experts.pack(w13, w2))
    want = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            want[t] += weights[t, j].double() * _expert(x[t:t + 1], w13, w2, int(ids[t, j]))[0]
    torch.testing.assert_close(counts, torch.bincount(ids.flatten(), minlength=E))
    torch.testing.assert_close(got.double(), want, **_tol(dtype))
    assert not got[::3].any()


def test_loaded_experts_are_held_packed_and_take_packed_slots(isa):
    """bf16 experts where the packed kernels run are held packed only (logical_weights gives them back exactly);
    a slot rewritten the way the online rebalancer writes it (expert_slot's packed tensors copied into it) is what
    the kernel then computes."""
    ex = Experts(64, 32, 4, list(range(4)), runner_backend="auto").to(torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        ex.w13.copy_(torch.randn(ex.w13.shape, generator=gen) * 0.125)
        ex.w2.copy_(torch.randn(ex.w2.shape, generator=gen) * 0.18)
    w13, w2 = ex.w13.detach().clone(), ex.w2.detach().clone()
    ex.process_weights_after_loading(torch.device("cpu"))
    assert ex.packed == (isa in BF16_DOT) and (ex.cpu_packed is not None) == ex.packed
    if ex.packed:
        assert ex.w13.dim() == 5 and ex.w13.nbytes == w13.nbytes  # no second copy
    assert all(torch.equal(a, b) for a, b in zip(ex.logical_weights(), (w13, w2), strict=True))
    new = {"gate": torch.randn(32, 64, generator=gen) * 0.125, "up": torch.randn(32, 64, generator=gen) * 0.125,
           "down": torch.randn(64, 32, generator=gen) * 0.18}
    with torch.no_grad():  # an EPLB swap: slot 1 rewritten in place with another expert
        for p, t in zip((ex.w13, ex.w2), ex.expert_slot(new.__getitem__, ("gate", "up", "down")), strict=True):
            p[1].copy_(t)
    ex.slots_changed()
    w13[1], w2[1] = torch.cat([new["gate"], new["up"]]).bfloat16(), new["down"].bfloat16()
    assert all(torch.equal(a, b) for a, b in zip(ex.logical_weights(), (w13, w2), strict=True))
    x = torch.randn(5, 64, generator=gen).bfloat16()
    offsets, counts = torch.tensor([0, 0, 5, 5, 5], dtype=torch.int32), torch.tensor([0, 5, 0, 0], dtype=torch.int32)
    got = cpu_experts.cpu_experts(x, ex.w13, ex.w2, offsets, counts, ex.cpu_packed)
    torch.testing.assert_close(got.double(), _expert(x, w13, w2, 1), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("B", "H", "D", "v_dim"), [(3, 4, 576, 512), (5, 16, 576, 512), (4, 3, 40, 24)])
def test_mla_decode(isa, dtype, B, H, D, v_dim):
    """DeepSeek's 576-wide latent at 4 and 16 heads, and a width that is not a multiple of 32."""
    gen = torch.Generator().manual_seed(B * H + len(isa))
    cache = torch.randn(400, D, generator=gen).to(dtype)
    lens = torch.randint(1, 90, (B,), generator=gen)
    lens[0] = 1
    indices = torch.randint(0, 400, (int(lens.sum()),), generator=gen)
    indptr = torch.zeros(B + 1, dtype=torch.int64)
    indptr[1:] = lens.cumsum(0)
    q = (torch.randn(B, H, D, generator=gen) * D**-0.25).to(dtype)
    want = cpu_mla_decode.mla_decode_reference(q.double(), cache.double(), indices, indptr, v_dim, D**-0.5)
    got = cpu_mla_decode.mla_decode(q, cache, indices, indptr, v_dim, D**-0.5)
    torch.testing.assert_close(got.double(), want, **_tol(dtype))


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(("N", "K"), [(576, 256), (1024, 2048), (33, 70), (7, 512), (130, 40)])
def test_skinny_gemm(isa, rows, N, K):
    """bf16 x W^T against float64 on the same bf16 values: widths that are and are not multiples of the vectors
    (32 bf16, 16 or 8 floats), column counts that are not multiples of the column blocks, weights large enough to
    be split over the threads and too small to be."""
    gen = torch.Generator().manual_seed(rows * N + K + len(isa))
    x = torch.randn(rows, K, generator=gen).bfloat16()
    w = (torch.randn(N, K, generator=gen) * K**-0.5).bfloat16()
    assert cpu_skinny_gemm.takes(x, w)
    assert cpu_skinny_gemm.uses_dpbf16() == (isa in BF16_DOT)
    got = cpu_skinny_gemm.cpu_skinny_gemm(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, N)
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, rtol=1.6e-2, atol=1e-2)


def test_skinny_gemm_takes_only_bf16_on_few_rows(isa, monkeypatch):
    """Linear's product (kernels/skinny_gemm.py) runs a kernel for CPU bf16 of few rows, with leading dimensions
    and rows that are not contiguous: the packed product for 1-MAX_PACKED_ROWS rows in the builds with AVX-512 BF16,
    else the row kernel for 1-4; F.linear for more rows, float32 and a weight that is a transposed view."""
    calls = []
    for name in ("cpu_skinny_gemm", "cpu_packed_gemm"):
        kernel = getattr(cpu_skinny_gemm, name)
        monkeypatch.setattr(cpu_skinny_gemm, name,
                            lambda x, w, name=name, kernel=kernel: calls.append((name, x.shape)) or kernel(x, w))
    gen = torch.Generator().manual_seed(len(isa))
    w = (torch.randn(96, 64, generator=gen) * 0.125).bfloat16()
    x = torch.randn(2, 2, 128, generator=gen).bfloat16()[..., ::2]  # [2, 2, 64], rows 256 bytes apart
    got = skinny_gemm.skinny_gemm(x, w)
    kernel = "cpu_packed_gemm" if isa in BF16_DOT else "cpu_skinny_gemm"
    assert calls == [(kernel, (2, 2, 64))] and got.shape == (2, 2, 96)
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, rtol=1.6e-2, atol=1e-2)
    rows = cpu_skinny_gemm.MAX_PACKED_ROWS if isa in BF16_DOT else cpu_skinny_gemm.MAX_ROWS
    more = torch.randn(rows + 1, 64, generator=gen).bfloat16()
    for xx, ww in [(more, w), (x.float(), w.float()), (x, w.T.contiguous().T)]:
        torch.testing.assert_close(skinny_gemm.skinny_gemm(xx, ww), F.linear(xx, ww))
    assert len(calls) == 1


@pytest.mark.parametrize("rows", [1, 3, 6, 7, 64])
@pytest.mark.parametrize(("N", "K"), [(576, 256), (1024, 2048), (48, 70), (16, 2)])
def test_packed_gemm(isa, rows, N, K, one_thread):
    """The packed product against float64 on the same bf16 values: row counts that are and are not multiples of
    its 6-row passes, column counts that are not multiples of its 64-column items, K not a multiple of 32, a weight
    large enough to be split over the threads."""
    if isa not in BF16_DOT:
        assert cpu_skinny_gemm.pack(torch.zeros(16, 2, dtype=torch.bfloat16)) is None
        pytest.skip(f"the {isa} build has no packed product")
    gen = torch.Generator().manual_seed(rows * N + K + len(isa))
    w = torch.nn.Parameter((torch.randn(N, K, generator=gen) * K**-0.5).bfloat16(), requires_grad=False)
    x = torch.randn(rows, K, generator=gen).bfloat16()
    assert cpu_skinny_gemm.packed_takes(x, w)
    got = cpu_skinny_gemm.cpu_packed_gemm(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, N)
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, rtol=1.6e-2, atol=1e-2)


def test_packed_products_stay_on_one_thread(isa):
    """Where torch runs several threads, a packed product past ONE_THREAD_WORK keeps F.linear (the packed kernel
    runs on one thread only); a smaller one, or any on one thread, takes the packed copy."""
    if isa not in BF16_DOT:
        pytest.skip(f"the {isa} build has no packed product")
    w = torch.nn.Parameter(torch.randn(512, 512).bfloat16(), requires_grad=False)
    small, large = torch.randn(1, 512).bfloat16(), torch.randn(64, 512).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert cpu_skinny_gemm.packed_takes(small, w) and not cpu_skinny_gemm.packed_takes(large, w)
        torch.set_num_threads(1)
        assert cpu_skinny_gemm.packed_takes(large, w)
    finally:
        torch.set_num_threads(before)


def test_packed_copy_follows_the_weight(isa):
    """The packed copy is made once per weight, made again when the weight is rewritten in place (the product
    follows the new values), and never for a view or a shape it cannot pack."""
    if isa not in BF16_DOT:
        pytest.skip(f"the {isa} build has no packed product")
    gen = torch.Generator().manual_seed(3)
    w = torch.nn.Parameter((torch.randn(32, 64, generator=gen) * 0.125).bfloat16(), requires_grad=False)
    first = cpu_skinny_gemm.packed_copy(w)
    assert first is not None and cpu_skinny_gemm.packed_copy(w) is first
    with torch.no_grad():
        w.copy_(torch.randn(32, 64, generator=gen).bfloat16())
    assert cpu_skinny_gemm.packed_copy(w) is not first
    x = torch.randn(3, 64, generator=gen).bfloat16()
    torch.testing.assert_close(skinny_gemm.skinny_gemm(x, w).double(), x.double() @ w.double().T, rtol=1.6e-2,
                               atol=1e-2)
    plain = torch.randn(64, 64, generator=gen).bfloat16()
    assert cpu_skinny_gemm.packed_copy(plain[:32]) is None  # a view
    assert cpu_skinny_gemm.packed_copy(torch.randn(24, 64).bfloat16()) is None  # 24 columns: not whole blocks


def test_mla_packed_kv_b_follows_the_weight(isa):
    """MLA's packed W_UK / W_UV (MLAttention._kv_b_packed): made once, made again when kv_b_proj's weight is
    rewritten in place (as a weight update does), and then the new weight's packing."""
    if isa not in BF16_DOT:
        pytest.skip(f"the {isa} build has no packed product")
    from moeserve.core.model_config import ModelConfig
    from moeserve.models.deepseek import MLAttention
    from moeserve.models.default_model import default_model_path

    attn = MLAttention(ModelConfig.from_pretrained(default_model_path()), 0, rotary=None)
    gen = torch.Generator().manual_seed(4)
    for p in attn.parameters():
        p.data = (torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5).bfloat16()
    attn.process_weights_after_loading(torch.device("cpu"))
    first = attn._kv_b_packed()
    assert first[0] is not None and first[1] is not None and attn._kv_b_packed() is first
    with torch.no_grad():
        attn.kv_b_proj.weight.copy_(torch.randn(attn.kv_b_proj.weight.shape, generator=gen).bfloat16())
    uk, uv = attn._kv_b_packed()
    assert uk is not first[0]
    w_uk, w_uv = attn._kv_b()
    assert torch.equal(uk, cpu_skinny_gemm.pack_groups(w_uk.transpose(1, 2)))
    assert torch.equal(uv, cpu_skinny_gemm.pack_groups(w_uv))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 16, 64])
@pytest.mark.parametrize(("heads", "nope", "v", "r"), [(4, 32, 32, 512), (3, 24, 40, 72), (16, 128, 128, 512)])
def test_batched_skinny_gemm_on_mla_views(isa, rows, heads, nope, v, r, one_thread):
    """MLA's absorbed decode as the model calls it (models/deepseek.py): q_nope's per-head rows through W_UK's
    transpose (N contiguous) into a fresh tensor, and the latent output's rows through W_UV (K contiguous) into
    the strided [h, B, v] view of a [B, h, v] tensor; against float64 on the same bf16 values. Widths that are
    and are not multiples of the vectors; V3's 128-wide heads on 16 of them (split over the threads). The row
    kernel takes 1-4 rows (torch.bmm more); the packed per-head copies of the AVX-512 BF16 builds up to MAX_PACKED_ROWS."""
    gen = torch.Generator().manual_seed(rows * heads + r + len(isa))
    kv_b = (torch.randn(heads * (nope + v), r, generator=gen) * r**-0.5).bfloat16()
    w = kv_b.view(heads, nope + v, r)
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    q_nope = torch.randn(rows, heads, nope + 16, generator=gen).bfloat16()[..., :nope]
    x1, w1 = q_nope.transpose(0, 1), w_uk.transpose(1, 2)
    assert w1.stride(1) == 1 and cpu_skinny_gemm.batched_takes(x1, w1) == (rows <= 4)
    got = skinny_gemm.batched_skinny_gemm(x1, w1)
    assert got.dtype == torch.bfloat16 and got.shape == (heads, rows, r)
    torch.testing.assert_close(got.double(), torch.bmm(x1.double(), w1.double().transpose(1, 2)), rtol=1.6e-2,
                               atol=1e-2)
    o_latent = torch.randn(rows, heads, r, generator=gen).bfloat16()
    out = torch.full((rows, heads, v), float("nan"), dtype=torch.bfloat16)
    x2 = o_latent.transpose(0, 1)
    assert w_uv.stride(2) == 1 and cpu_skinny_gemm.batched_takes(x2, w_uv, out.transpose(0, 1)) == (rows <= 4)
    skinny_gemm.batched_skinny_gemm(x2, w_uv, out=out.transpose(0, 1))
    want = torch.bmm(x2.double(), w_uv.double().transpose(1, 2)).transpose(0, 1)
    torch.testing.assert_close(out.double(), want, rtol=1.6e-2, atol=1e-2)
    # the packed per-head copies (the AVX-512 BF16 builds), as the model passes them
    uk_packed, uv_packed = cpu_skinny_gemm.pack_groups(w1), cpu_skinny_gemm.pack_groups(w_uv)
    if isa not in BF16_DOT or v % 16 or r % 16:  # no AVX-512 BF16, or widths not whole 16-column blocks
        assert uv_packed is None or uk_packed is None
        return
    assert cpu_skinny_gemm.batched_packed_takes(x1, uk_packed)
    got = skinny_gemm.batched_skinny_gemm(x1, w1, packed=uk_packed)
    torch.testing.assert_close(got.double(), torch.bmm(x1.double(), w1.double().transpose(1, 2)), rtol=1.6e-2,
                               atol=1e-2)
    out.fill_(float("nan"))
    assert cpu_skinny_gemm.batched_packed_takes(x2, uv_packed, out.transpose(0, 1))
    skinny_gemm.batched_skinny_gemm(x2, w_uv, out=out.transpose(0, 1), packed=uv_packed)
    torch.testing.assert_close(out.double(), want, rtol=1.6e-2, atol=1e-2)


def test_batched_skinny_gemm_takes_only_bf16_on_few_rows(isa, monkeypatch):
    """torch.bmm for 5 rows, float32, and a weight with neither K nor N contiguous; the kernel for 1-4 rows."""
    calls = []
    kernel = cpu_skinny_gemm.cpu_batched_skinny_gemm
    monkeypatch.setattr(cpu_skinny_gemm, "cpu_batched_skinny_gemm",
                        lambda x, w, out=None: calls.append(x.shape) or kernel(x, w, out))
    gen = torch.Generator().manual_seed(len(isa))
    w = (torch.randn(4, 48, 64, generator=gen) * 0.125).bfloat16()
    for x in (torch.randn(4, 5, 64, generator=gen).bfloat16(), torch.randn(4, 2, 64, generator=gen)):
        ww = w if x.dtype == torch.bfloat16 else w.float()
        torch.testing.assert_close(skinny_gemm.batched_skinny_gemm(x, ww), torch.bmm(x, ww.transpose(1, 2)))
    strided = torch.randn(4, 48, 128, generator=gen).bfloat16()[..., ::2]  # neither K nor N contiguous
    x = torch.randn(4, 2, 64, generator=gen).bfloat16()
    torch.testing.assert_close(skinny_gemm.batched_skinny_gemm(x, strided), torch.bmm(x, strided.transpose(1, 2)))
    assert calls == []
    skinny_gemm.batched_skinny_gemm(x, w)
    assert calls == [(4, 2, 64)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(("T", "H", "r", "R"), [(1, 4, 512, 64), (7, 6, 40, 24), (70, 16, 512, 64)])
def test_mla_rope_cache_is_the_references(isa, T, H, r, R, interleaved, dtype):
    """The C++ latent write against kernels/mla_rope_cache.py's torch reference on the model's strided views
    (q_rope a slice of q, c_kv and k_rope of one projection), scattered unordered slots and every other cache row
    random: the rotations bit for bit, the norm to a rounding (its sum of squares in another order), rows outside
    loc untouched. 70 tokens are split over the threads."""
    gen = torch.Generator().manual_seed(T * 100 + H + r + interleaved + len(isa))
    q = torch.randn(T, H, 24 + R, generator=gen).to(dtype)
    kv = (3 * torch.randn(T, r + R, generator=gen)).to(dtype)
    c_kv, k_rope = kv.split([r, R], dim=-1)
    angles = torch.rand(T, R, generator=gen) * 6.3
    rope = torch.stack((angles.cos(), angles.sin() * torch.where(torch.arange(R) % 2 == 0, -1.0, 1.0)), dim=1)
    N = 3 * T + 11
    args = dict(q_rope=q[..., 24:], c_kv=c_kv, k_rope=k_rope,
                norm_weight=(1 + 0.1 * torch.randn(r, generator=gen)).to(dtype), eps=1e-6, rope=rope,
                interleaved=interleaved, loc=torch.randperm(N, generator=gen)[:T])
    cache = torch.randn(N, r + R, generator=gen).to(dtype)
    want_cache = cache.clone()
    want_q = mla_rope_cache.mla_rope_cache_reference(**args, cache=want_cache)
    assert cpu_mla_rope_cache.takes(args["q_rope"], c_kv, k_rope, args["norm_weight"], rope, cache)
    got_q = mla_rope_cache.mla_rope_cache(**args, cache=cache)
    assert torch.equal(got_q, want_q)
    assert torch.equal(cache[:, r:], want_cache[:, r:])
    tol = dict(rtol=1.6e-2, atol=1e-5) if dtype is torch.bfloat16 else dict(rtol=4e-7, atol=1e-6)
    torch.testing.assert_close(cache[:, :r], want_cache[:, :r], **tol)
    untouched = torch.ones(N, dtype=torch.bool)
    untouched[args["loc"]] = False
    assert torch.equal(cache[untouched], want_cache[untouched])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("T", "D"), [(1, 256), (5, 100), (64, 1536)])
def test_rms_norm(isa, dtype, T, D):
    """The C++ RMSNorm with and without the residual add against the torch reference: h bit for bit, y to one
    rounding of its dtype (the sum of squares in another order)."""
    gen = torch.Generator().manual_seed(T * D + len(isa))
    x, res = (torch.randn(2, T, D, generator=gen) * 5).to(dtype)
    w = (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype)
    assert cpu_rms_norm.takes(x, w, res)
    tol = dict(rtol=1.6e-2, atol=1e-5) if dtype is torch.bfloat16 else dict(rtol=4e-7, atol=1e-6)
    torch.testing.assert_close(cpu_rms_norm.cpu_rms_norm(x, w, 1e-6), rms_norm.rms_norm_reference(x, w, 1e-6), **tol)
    (y, h), (want_y, want_h) = cpu_rms_norm.cpu_rms_norm(x, w, 1e-6, res), rms_norm.rms_norm_reference(x, w, 1e-6, res)
    assert torch.equal(h, want_h)
    torch.testing.assert_close(y, want_y, **tol)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump to read the builds")
def test_only_the_bf16_builds_skinny_gemm_has_bf16_dot_products(isa):
    cpu_skinny_gemm.load()
    path = next(p for p in (build.cache_root() / "kernels").glob(f"cpu_skinny_gemm-{isa}-*.so"))
    asm = subprocess.run(["objdump", "-d", str(path)], capture_output=True, text=True, timeout=120).stdout
    assert ("vdpbf16ps" in asm) == (isa in BF16_DOT)
    if isa == "avx2":
        assert re.search(r"%zmm|%ymm(1[6-9]|2[0-9]|3[01])\b", asm) is None


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump to read the builds")
def test_each_build_holds_only_its_isa(isa):
    """The avx2 build has no AVX-512 register (zmm, or ymm16-31 of EVEX); only the amx build multiplies on tiles."""
    cpu_experts.load()
    path = next(p for p in (build.cache_root() / "kernels").glob(f"cpu_experts-{isa}-*.so"))
    asm = subprocess.run(["objdump", "-d", str(path)], capture_output=True, text=True, timeout=120).stdout
    if isa == "avx2":
        assert re.search(r"%zmm|%ymm(1[6-9]|2[0-9]|3[01])\b", asm) is None
    assert ("tdpbf16ps" in asm) == (isa == "amx")


def test_an_isa_the_cpu_lacks_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_isa, "supported", lambda: ("avx2",))
    monkeypatch.setattr(cpu_isa, "missing", lambda isa: ("amx_tile", "amx_bf16"))
    monkeypatch.setattr(cpu_isa, "is_x86", lambda: True)
    with pytest.raises(ValueError, match="--cpu-isa amx: this CPU lacks amx_tile, amx_bf16"):
        ServerArgs(cpu_isa="amx")
    assert cpu_isa.check("avx2") is None


def test_compiled_call_with_the_packed_copy(isa):
    """Under torch.compile the packed weights go through the custom op's optional arguments."""
    gen = torch.Generator().manual_seed(9)
    w13, w2 = _weights(gen, 4, 64, 32, torch.bfloat16)
    packed = cpu_experts.pack(w13, w2)
    x = torch.randn(6, 64, generator=gen).bfloat16()
    ids = torch.randint(0, 4, (6, 2), generator=gen)
    weights = torch.rand(6, 2, generator=gen)
    fn = torch.compile(lambda *a: cpu_experts.cpu_moe_local(*a, packed)[0] * 2, fullgraph=True)
    torch.testing.assert_close(fn(x, ids, weights, w13, w2), cpu_experts.cpu_moe_local(x, ids, weights, w13, w2,
                                                                                      packed)[0] * 2)
