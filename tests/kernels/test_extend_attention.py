"""The Triton extend (prefill) attention against its torch reference, and the reference against the serving path's
padded-group SDPA (layers/attention/ops.py), on ragged requests with cached prefixes."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.extend_attention import extend_attention_reference, extend_seqs
from moeserve.layers.attention.ops import extend_attention as grouped_extend_attention


def _case(extend_lens, seq_lens, hq, hkv, d, dv, rope, dtype, seed, shared_rope=True):
    gen = torch.Generator().manual_seed(seed)
    T, S = sum(extend_lens), sum(seq_lens)
    q = torch.randn(T, hq, d, generator=gen).to(dtype)
    kv = torch.randn(S, hkv, d + dv, generator=gen).to(dtype)  # k and v as column ranges of one tensor (MLA's kv)
    k, v = kv[..., :d], kv[..., d:]
    q_rope = k_rope = None
    if rope:
        q_rope = torch.randn(T, hq, rope, generator=gen).to(dtype)
        k_rope = torch.randn(S, rope, generator=gen).to(dtype) if shared_rope else \
            torch.randn(S, hkv, rope, generator=gen).to(dtype)
    return q, k, v, q_rope, k_rope


def test_reference_matches_grouped_sdpa():
    """The reference with the rope parts apart equals SDPA over padded groups with them concatenated."""
    ext, seqs_l = [5, 1, 9, 3], [12, 1, 9, 40]
    q, k, v, q_rope, k_rope = _case(ext, seqs_l, 4, 2, 16, 8, 8, torch.float64, 0)
    seqs = extend_seqs(ext, seqs_l, "cpu")
    got = extend_attention_reference(q, k, v, seqs, max(ext), 0.3, q_rope, k_rope)
    k_full = torch.cat((k, k_rope[:, None, :].expand(-1, 2, -1)), -1)
    want = grouped_extend_attention(torch.cat((q, q_rope), -1), k_full, v, ext, seqs_l, 0.3)
    torch.testing.assert_close(got, want)
    window = extend_attention_reference(q, k, v, seqs, max(ext), 0.3, q_rope, k_rope, sliding_window=4)
    torch.testing.assert_close(window, grouped_extend_attention(torch.cat((q, q_rope), -1), k_full, v, ext, seqs_l,
                                                               0.3, sliding_window=4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ext, seq_lens, hq, hkv, d, dv, rope, window", [
    ([1], [1], 2, 2, 16, 16, 0, None),  # a single token
    ([37, 0, 5], [37, 3, 70], 4, 2, 32, 16, 0, None),  # GQA, a request with no new token, a long prefix
    ([70, 19], [70, 90], 4, 4, 32, 32, 8, None),  # MLA-shaped: rope apart (narrower than a dot's 16), shared key
    ([45, 8], [60, 8], 6, 2, 24, 20, 0, 13),  # heads not powers of two, a sliding window
])
def test_extend_attention_matches_reference(dtype, ext, seq_lens, hq, hkv, d, dv, rope, window, device):
    from moeserve.kernels.triton_ops.extend_attention import extend_attention

    q, k, v, q_rope, k_rope = _case(ext, seq_lens, hq, hkv, d, dv, rope, dtype, sum(ext) + hq)
    seqs = extend_seqs(ext, seq_lens, device)
    scale = (d + rope) ** -0.5
    dbl = [None if t is None else t.double() for t in (q_rope, k_rope)]
    ref = extend_attention_reference(q.double(), k.double(), v.double(), seqs.cpu(), max(ext), scale, *dbl,
                                     sliding_window=window)
    on = [None if t is None else t.to(device) for t in (q_rope, k_rope)]
    config = (16, 16, 4, 1) if device == "cpu" else None  # several blocks of queries and keys at these sizes
    got = extend_attention(q.to(device), k.to(device), v.to(device), seqs, max(ext), scale, *on,
                           sliding_window=window, config=config)
    assert got.dtype == dtype and got.shape == (sum(ext), hq, dv)
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: the probabilities are rounded before the second dot
    torch.testing.assert_close(got.cpu().double(), ref, atol=tol, rtol=tol)


def test_wide_addresses(device):
    """The 64-bit key addressing (taken where the keys span 2^31 elements) gives the same values."""
    from moeserve.kernels.triton_ops.extend_attention import extend_attention

    ext, seq_lens = [9, 20], [30, 20]
    q, k, v, q_rope, k_rope = _case(ext, seq_lens, 4, 2, 16, 16, 8, torch.float32, 4)
    seqs = extend_seqs(ext, seq_lens, device)
    args = (*(t.to(device) for t in (q, k, v)), seqs, 20, 0.3, q_rope.to(device), k_rope.to(device))
    torch.testing.assert_close(extend_attention(*args, config=(16, 16, 4, 1), wide=True).cpu(),
                               extend_attention_reference(q, k, v, seqs.cpu(), 20, 0.3, q_rope, k_rope),
                               atol=1e-5, rtol=1e-5)


def test_rope_key_per_head(device):
    from moeserve.kernels.triton_ops.extend_attention import extend_attention

    ext, seq_lens = [20, 7], [33, 7]
    q, k, v, q_rope, k_rope = _case(ext, seq_lens, 4, 2, 16, 16, 16, torch.float32, 3, shared_rope=False)
    seqs = extend_seqs(ext, seq_lens, device)
    ref = extend_attention_reference(q, k, v, seqs.cpu(), 20, 0.2, q_rope, k_rope)
    got = extend_attention(*(t.to(device) for t in (q, k, v)), seqs, 20, 0.2, q_rope.to(device), k_rope.to(device),
                           config=(16, 16, 4, 1))
    torch.testing.assert_close(got.cpu(), ref, atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_refused(device):
    from moeserve.kernels.triton_ops.extend_attention import extend_attention

    q, k, v, q_rope, k_rope = _case([4], [4], 4, 2, 16, 16, 8, torch.float32, 1)
    seqs = extend_seqs([4], [4], device)
    with pytest.raises(ValueError, match="do not fit"):
        extend_attention(q.to(device), k.to(device), v.to(device), seqs, 4, 0.1, q_rope.to(device), None)
    with pytest.raises(ValueError, match="do not fit"):
        extend_attention(q[:, :3].to(device), k.to(device), v.to(device), seqs, 4, 0.1)


def test_kernel_plan_through_the_serving_path():
    """layers/attention/ops.py with a kernel plan (what CUDA steps build) runs the kernel's signature on the seqs
    table, copied to the device on first use, and gives what the padded groups give."""
    from moeserve.layers.attention.extend_plan import ExtendPlan

    ext, seq_lens = [6, 2, 11], [6, 30, 11]
    q, k, v, q_rope, k_rope = _case(ext, seq_lens, 4, 4, 16, 16, 8, torch.float64, 7)
    plan = ExtendPlan.build(ext, seq_lens, "cpu", kernel=True)
    assert plan.groups == [] and plan.max_extend == 11 and plan._seqs is None
    got = grouped_extend_attention(q, k, v, ext, seq_lens, 0.25, plan=plan, q_rope=q_rope, k_rope=k_rope)
    assert plan.seqs.tolist() == [[0, 6, 0, 6], [6, 2, 6, 30], [8, 11, 36, 11]]
    want = grouped_extend_attention(q, k, v, ext, seq_lens, 0.25, q_rope=q_rope, k_rope=k_rope)
    torch.testing.assert_close(got, want)
