"""moeserve's CPU absorbed-extend kernel (moeserve/kernels/cpu_latent_extend.py) against its float64 reference, on
every ISA build (--cpu-isa), and against the torch form it replaces (layers/attention/latent_extend.py's padded
groups over the gathered rows) through `absorbed_extend`."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels import cpu_latent_extend
from moeserve.layers.attention import latent_extend
from moeserve.layers.attention.extend_plan import ExtendPlan

pytestmark = pytest.mark.skipif(cpu_latent_extend.load() is None, reason="no C++ compiler: the kernel cannot build")


def _case(lens: list[tuple[int, int]], H: int, D: int, dtype: torch.dtype, seed: int):
    """Requests of (new rows, keys): q [T, H, D] float32, a cache [N, D] of dtype with every request's slots
    scattered over it (no slot shared), kv_indices, kv_indptr, q_indptr."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(s for _, s in lens)
    cache = torch.randn(total + 37, D, generator=gen).to(dtype)
    indices = torch.randperm(total + 37, generator=gen)[:total]
    kv_indptr = torch.tensor([0, *[s for _, s in lens]]).cumsum(0)
    q_indptr = torch.tensor([0, *[n for n, _ in lens]]).cumsum(0)
    q = torch.randn(int(q_indptr[-1]), H, D, generator=gen)
    return q, cache, indices, kv_indptr, q_indptr


# (new rows, keys) per request: a prompt with no prefix, a tail over a long prefix, one row, rows that are not a
# multiple of the kernel's tiles; shapes: the default model's, DeepSeek's latent, widths off the vector width
CASES = [([(5, 5), (80, 1080), (1, 300), (17, 40)], 4, 80, 64),
         ([(1, 1), (33, 97), (64, 64)], 16, 576, 512),
         ([(7, 50), (3, 3)], 3, 37, 20),
         ([(130, 200)], 1, 24, 24)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lens", "H", "D", "v_dim"), CASES)
def test_kernel_matches_float64_reference(isa, dtype, lens, H, D, v_dim):
    q, cache, indices, kv_indptr, q_indptr = _case(lens, H, D, dtype, seed=H * D + len(isa))
    scale = D**-0.5
    want = cpu_latent_extend.latent_extend_reference(q.double(), cache.double(), indices, kv_indptr, q_indptr,
                                                     v_dim, scale)
    got = cpu_latent_extend.latent_extend(q, cache, indices, kv_indptr, q_indptr, v_dim, scale)
    assert got.shape == (q.shape[0], H, v_dim) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_threads_give_the_same_rows():
    """Work items split over OpenMP threads: each row's sums are the same whichever thread ran it."""
    q, cache, indices, kv_indptr, q_indptr = _case([(200, 900), (64, 64), (31, 500)], 4, 80, torch.float32, seed=5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_latent_extend.latent_extend(q, cache, indices, kv_indptr, q_indptr, 64, 0.1)
        torch.set_num_threads(2)
        two = cpu_latent_extend.latent_extend(q, cache, indices, kv_indptr, q_indptr, 64, 0.1)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_absorbed_extend_matches_the_torch_form(monkeypatch):
    """The layer's whole absorbed extend (q through W_UK, the attention, out through W_UV) with the kernel and with
    the torch form over the plan's padded groups, for a batch of requests with and without prefixes."""
    lens = [(9, 9), (40, 300), (1, 120), (66, 90)]
    H, nope, r, R, v = 4, 32, 64, 16, 32
    q, cache, indices, kv_indptr, _ = _case(lens, H, r + R, torch.float32, seed=11)
    gen = torch.Generator().manual_seed(12)
    q_nope, q_rope = torch.randn(q.shape[0], H, nope, generator=gen), torch.randn(q.shape[0], H, R, generator=gen)
    w_uk, w_uv = torch.randn(H, nope, r, generator=gen) * 0.1, torch.randn(H, v, r, generator=gen) * 0.1
    extend_lens, seq_lens = [n for n, _ in lens], [s for _, s in lens]
    plan = ExtendPlan.build(extend_lens, seq_lens, "cpu")
    args = (q_nope, q_rope, cache, indices, kv_indptr, w_uk, w_uv, plan, extend_lens, 0.125)
    got = latent_extend.absorbed_extend(*args)
    monkeypatch.setattr(cpu_latent_extend, "takes", lambda q, cache: False)
    want = latent_extend.absorbed_extend(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_offsets_are_refused():
    q, cache, indices, kv_indptr, q_indptr = _case([(4, 10), (6, 6)], 2, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="fewer keys than new rows"):
        cpu_latent_extend.latent_extend(q, cache, indices, kv_indptr, torch.tensor([0, 3, 10]), 8, 0.1)  # 7 rows, 6 keys
    with pytest.raises(ValueError, match="q offsets"):
        cpu_latent_extend.latent_extend(q, cache, indices, kv_indptr, torch.tensor([0, 4, 9]), 8, 0.1)


def test_bf16_absorbed_extend_takes_the_decodes_packed_products(monkeypatch):
    """A bf16 model's absorbed extend of a few dozen rows multiplies through W_UK and W_UV with the decode's packed
    bf16 products (no float32 copy of the weights), and lands within bf16's rounding of the float32 products."""
    from moeserve.kernels import cpu_skinny_gemm

    H, nope, r, R, v = 4, 32, 64, 16, 32
    lens = [(40, 300), (9, 9)]
    q, cache, indices, kv_indptr, _ = _case(lens, H, r + R, torch.bfloat16, seed=21)
    gen = torch.Generator().manual_seed(22)
    q_nope = torch.randn(q.shape[0], H, nope, generator=gen).bfloat16()
    q_rope = torch.randn(q.shape[0], H, R, generator=gen).bfloat16()
    w_uk = (torch.randn(H, nope, r, generator=gen) * 0.2).bfloat16()
    w_uv = (torch.randn(H, v, r, generator=gen) * 0.2).bfloat16()
    packed = cpu_skinny_gemm.pack_groups(w_uk.transpose(1, 2)), cpu_skinny_gemm.pack_groups(w_uv)
    if packed[0] is None:
        pytest.skip("this build has no AVX-512 BF16 products (pack_groups gives no copy)")
    extend_lens, seq_lens = [n for n, _ in lens], [s for _, s in lens]
    args = (q_nope, q_rope, cache, indices, kv_indptr, w_uk, w_uv, ExtendPlan.build(extend_lens, seq_lens, "cpu"),
            extend_lens, 0.125)
    calls = []
    real = cpu_skinny_gemm.cpu_batched_packed_gemm
    monkeypatch.setattr(cpu_skinny_gemm, "cpu_batched_packed_gemm", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = latent_extend.absorbed_extend(*args, packed=packed)
    assert len(calls) == 2 and got.dtype == torch.bfloat16
    want = latent_extend.absorbed_extend(*args)  # float32 products
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
