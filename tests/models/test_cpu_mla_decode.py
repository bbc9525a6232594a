"""moeserve's CPU MLA decode kernel (moeserve/kernels/cpu_mla_decode.py) against its float64 reference and against
the padded-block attention (layers/attention/ops.decode_attention) that it replaces on the CPU."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels import cpu_mla_decode
from moeserve.layers.attention.ops import decode_attention, padded_kv_slots

pytestmark = pytest.mark.skipif(cpu_mla_decode.load() is None, reason="no C++ compiler: the kernel cannot build")


def _case(B: int, H: int, D: int, N: int, max_len: int, seed: int):
    """Random q [B, H, D], cache [N, D], ragged slots (scattered, repeats allowed) with kv_indptr."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(N, D, generator=gen)
    lens = torch.randint(1, max_len + 1, (B,), generator=gen)
    indices = torch.randint(0, N, (int(lens.sum()),), generator=gen)
    indptr = torch.zeros(B + 1, dtype=torch.int64)
    indptr[1:] = lens.cumsum(0)
    q = torch.randn(B, H, D, generator=gen) * D**-0.25
    return q, cache, indices, indptr, lens


@pytest.mark.parametrize(("B", "H", "D", "v_dim"), [
    (3, 4, 576, 512),  # DeepSeek's latent: 512 + 64 rope
    (5, 3, 37, 20),  # widths that are not a multiple of 8, an odd head count
    (1, 16, 72, 64),  # more heads than one work item holds; a batch of one splits its heads over threads
    (7, 1, 24, 16),
    (2, 9, 40, 40),  # value = the whole row
])
def test_kernel_matches_float64_reference(B, H, D, v_dim):
    q, cache, indices, indptr, _ = _case(B, H, D, N=300, max_len=70, seed=B * 100 + H)
    scale = D**-0.5
    want = cpu_mla_decode.mla_decode_reference(q.double(), cache.double(), indices, indptr, v_dim, scale)
    got = cpu_mla_decode.mla_decode(q, cache, indices, indptr, v_dim, scale)
    assert got.shape == (B, H, v_dim) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_equals_the_padded_block_attention():
    """The path it replaces: decode_attention over the padded slot block, the latent as one KV head."""
    q, cache, indices, indptr, lens = _case(6, 4, 80, N=200, max_len=33, seed=7)
    slots, bias = padded_kv_slots(indices, indptr, lens, int(lens.max()))
    want = decode_attention(q, cache[:, None, :], 64, slots, bias, 0.2)
    torch.testing.assert_close(cpu_mla_decode.mla_decode(q, cache, indices, indptr, 64, 0.2), want,
                               rtol=1e-5, atol=1e-5)


def test_bf16_cache_sums_in_fp32():
    q, cache, indices, indptr, _ = _case(4, 4, 96, N=150, max_len=40, seed=3)
    cache = cache.bfloat16()
    want = cpu_mla_decode.mla_decode_reference(q.double(), cache.double(), indices, indptr, 64, 0.1)
    got = cpu_mla_decode.mla_decode(q.bfloat16(), cache, indices, indptr, 64, 0.1)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)


def test_one_thread_and_two_agree():
    q, cache, indices, indptr, _ = _case(2, 6, 64, N=100, max_len=50, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_mla_decode.mla_decode(q, cache, indices, indptr, 48, 0.3)
        torch.set_num_threads(2)
        two = cpu_mla_decode.mla_decode(q, cache, indices, indptr, 48, 0.3)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one, two, rtol=0, atol=0)


def test_a_request_without_rows_gets_zeros():
    q, cache, indices, indptr, _ = _case(3, 2, 32, N=50, max_len=10, seed=9)
    indptr[2:] -= indptr[2] - indptr[1]  # request 1 has no rows now
    got = cpu_mla_decode.mla_decode(q, cache, indices[: int(indptr[-1])], indptr, 16, 0.5)
    assert torch.count_nonzero(got[1]) == 0 and torch.count_nonzero(got[0]) > 0


def test_cache_of_another_width_is_refused():
    q, cache, indices, indptr, _ = _case(2, 2, 32, N=50, max_len=10, seed=1)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_mla_decode.mla_decode(q, cache[:, :16].contiguous(), indices, indptr, 16, 0.5)
