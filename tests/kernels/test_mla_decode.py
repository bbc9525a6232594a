"""The Triton MLA decode (split-KV, over the slot table) against its torch reference, and the reference against a
per-request softmax written out directly (float64)."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.mla_decode import mla_decode_reference


def _case(B: int, H: int, v_dim: int, rope: int, seq_lens: list[int], L: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    N = 3 * L + 8
    q = torch.randn(B, H, v_dim + rope, generator=gen).to(dtype)
    cache = torch.randn(N, v_dim + rope, generator=gen).to(dtype)
    slots = torch.stack([torch.randperm(N, generator=gen)[:L] for _ in range(B)])  # scattered rows
    return q, cache, slots, torch.tensor(seq_lens, dtype=torch.int64)


def test_reference_is_softmax_attention_per_request():
    q, cache, slots, lens = _case(3, 4, 32, 16, [5, 0, 9], 9, torch.float64, 0)
    got = mla_decode_reference(q, cache, slots, lens, 32, 0.3)
    for b in range(3):
        rows = cache[slots[b, : lens[b]]]
        want = torch.softmax(0.3 * q[b] @ rows.T, -1) @ rows[:, :32] if lens[b] else torch.zeros(4, 32, dtype=q.dtype)
        torch.testing.assert_close(got[b], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, H, v_dim, rope, seq_lens, L", [
    (1, 4, 32, 16, [1], 1),  # one row, heads below the block of 16
    (2, 4, 32, 8, [3, 7], 7),  # a rope part narrower than a dot's 16 (the tiny test models')
    (3, 20, 64, 16, [70, 0, 33], 80),  # two head blocks (the second partial), an empty request, ragged lengths
    (2, 16, 32, 32, [200, 129], 200),  # several splits of several row blocks
])
def test_mla_decode_matches_reference(dtype, B, H, v_dim, rope, seq_lens, L, device):
    from moeserve.kernels.triton_ops.mla_decode import mla_decode

    q, cache, slots, lens = _case(B, H, v_dim, rope, seq_lens, L, dtype, B * 100 + H)
    scale = (v_dim + rope) ** -0.5
    ref = mla_decode_reference(q.double(), cache.double(), slots, lens, v_dim, scale)
    got = mla_decode(q.to(device), cache.to(device), slots.to(device), lens.to(device), v_dim, scale)
    assert got.dtype == dtype and got.shape == (B, H, v_dim)
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: the probabilities are rounded before the second dot
    torch.testing.assert_close(got.cpu().double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_query_parts_apart(dtype, device):
    """q_rope given apart, and the latent part a per-head bmm's transposed output (what MLA decode hands over)."""
    from moeserve.kernels.triton_ops.mla_decode import mla_decode

    q, cache, slots, lens = _case(3, 20, 64, 16, [40, 1, 17], 40, dtype, 5)
    q_latent = q[..., :64].transpose(0, 1).contiguous().transpose(0, 1)  # [B, h, r] with strides (r, B * r, 1)
    q_rope = q[..., 64:].clone()
    assert not q_latent.is_contiguous()
    ref = mla_decode_reference(q.double(), cache.double(), slots, lens, 64, 0.1)
    assert torch.equal(mla_decode_reference(q_latent, cache, slots, lens, 64, 0.1, q_rope=q_rope),
                       mla_decode_reference(q, cache, slots, lens, 64, 0.1))
    got = mla_decode(q_latent.to(device), cache.to(device), slots.to(device), lens.to(device), 64, 0.1,
                     q_rope=q_rope.to(device))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.cpu().double(), ref, atol=tol, rtol=tol)


def test_split_plan_fills_the_gpu_and_covers_every_row():
    from moeserve.kernels.triton_ops.mla_decode import MAX_SPLITS, plan_splits

    for B, H, L in [(1, 16, 4096), (1, 16, 20), (64, 16, 200), (256, 128, 4096), (3, 4, 0)]:
        splits, split_len = plan_splits(B, H, L, 32, 132)
        assert 1 <= splits <= MAX_SPLITS and split_len % 32 == 0 and splits * split_len >= L
        assert (splits - 1) * split_len < max(L, 1)  # no split starts past the end
    assert plan_splits(1, 16, 4096, 32, 132)[0] == MAX_SPLITS  # batch 1: as many splits as allowed
    assert plan_splits(256, 128, 4096, 32, 132)[0] == 1  # 2,048 programs fill the GPU without splitting
