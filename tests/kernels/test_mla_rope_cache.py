"""The fused MLA latent write (RMSNorm + rotary + cache write, kernels/mla_rope_cache.py) against its torch
reference, and the reference against the model's own RotaryEmbedding and RMSNorm.

Tolerances: the rotations are compared bit for bit on CUDA (the kernel keeps torch's rounding order: two rounded
products, a rounded sum, one rounding to the activations' dtype) and in float32 under the interpreter; Triton's
interpreter rounds float32 -> bfloat16 by truncation, so there bf16 values may be one bf16 ulp off. The norm is
compared to one rounding step (fp32: 1e-5; bf16: torch's default 1.6e-2 relative): 1/sqrt against torch's
rsqrt, and the sum over the row in another order, may move the fp32 statistic by an ulp.
"""

from __future__ import annotations

import pytest
import torch

from moeserve.core.model_config import RopeConfig
from moeserve.kernels.mla_rope_cache import mla_rope_cache_reference
from moeserve.kernels.rms_norm import rms_norm_reference
from moeserve.layers.rotary import RotaryEmbedding

YARN = RopeConfig(theta=10000.0, type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=1.0,
                  mscale_all_dim=0.707)  # V2's: an attention factor that is not 1


def _inputs(T: int, H: int, r: int, R: int, interleaved: bool, dtype: torch.dtype, cache_dtype: torch.dtype,
            seed: int, device: str = "cpu") -> dict:
    """Strided views as the model has them: q_rope a slice of q, c_kv and k_rope slices of one projection (made
    on `device`: moving a view to another device would copy it densely)."""
    gen = torch.Generator().manual_seed(seed)
    nope, N = 24, 3 * T + 11
    q = torch.randn(T, H, nope + R, generator=gen).to(device, dtype)
    kv = (3 * torch.randn(T, r + R, generator=gen)).to(device, dtype)
    c_kv, k_rope = kv.split([r, R], dim=-1)
    rotary = RotaryEmbedding(R, RopeConfig(**{**YARN.__dict__, "interleaved": interleaved}))
    positions = torch.randint(0, 8192, (T,), generator=gen)
    return dict(q_rope=q[..., nope:], c_kv=c_kv, k_rope=k_rope,
                norm_weight=(1 + 0.1 * torch.randn(r, generator=gen)).to(device, dtype), eps=1e-6,
                rope=rotary(positions).to(device), interleaved=interleaved,
                # every row random: stray writes show
                cache=torch.randn(N, r + R, generator=gen).to(device, cache_dtype),
                loc=torch.randperm(N, generator=gen)[:T].to(device))  # scattered, unordered slots


def _on_cpu(args: dict) -> dict:
    """A CPU copy, with q_rope, c_kv and k_rope views of the same layout (the reference's inputs)."""
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def test_reference_rotation_is_the_models():
    """The reference's rotations are RotaryEmbedding.apply's bit for bit, both layouts, and the cached c_kv is
    RMSNorm's."""
    for interleaved in (False, True):
        a = _inputs(5, 3, 16, 8, interleaved, torch.bfloat16, torch.bfloat16, 1)
        rotary = RotaryEmbedding(8, RopeConfig(**{**YARN.__dict__, "interleaved": interleaved}))
        assert rotary.attention_factor != 1.0
        want = rotary.apply(a["q_rope"], a["rope"])
        cache = a["cache"].clone()
        q = mla_rope_cache_reference(**a)
        assert torch.equal(q, want)
        assert torch.equal(a["cache"][a["loc"], 16:], rotary.apply(a["k_rope"][:, None], a["rope"])[:, 0])
        assert torch.equal(a["cache"][a["loc"], :16], rms_norm_reference(a["c_kv"], a["norm_weight"], 1e-6))
        untouched = torch.ones(cache.shape[0], dtype=torch.bool)
        untouched[a["loc"]] = False
        assert torch.equal(a["cache"][untouched], cache[untouched])


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("T, H, r, R", [
    (1, 4, 32, 16),  # one token (batch-1 decode)
    (7, 6, 40, 24),  # T odd, r and R not powers of two
    (5, 20, 48, 64),  # two head blocks of 16, the second partial
    (3, 16, 512, 64),  # V2-Lite's latent, rope and heads
])
def test_mla_rope_cache_matches_reference(T, H, r, R, interleaved, dtype, cache_dtype, device):
    from moeserve.kernels.triton_ops.mla_rope_cache import mla_rope_cache

    dev = _inputs(T, H, r, R, interleaved, dtype, cache_dtype, T * 1000 + H * 10 + r + interleaved, device)
    args = _on_cpu(dev)
    want_cache = args["cache"].clone()
    want_q = mla_rope_cache_reference(**{**args, "cache": want_cache})
    assert dev["q_rope"].stride(-1) == 1 and not dev["q_rope"].is_contiguous()  # the kernel reads the view
    got_q = mla_rope_cache(**dev)
    got_cache = dev["cache"].cpu()
    assert got_q.dtype == dtype and got_q.shape == (T, H, R) and got_cache.dtype == cache_dtype

    exact = device == "cuda" or dtype == torch.float32
    _assert_rotation_equal(got_q.cpu(), want_q, exact)
    _assert_rotation_equal(got_cache[:, r:], want_cache[:, r:], exact)  # the roped key; rows not in loc unchanged
    written = got_cache[args["loc"]]
    assert torch.equal(written.to(dtype).to(cache_dtype), written)  # rounded to the activations' dtype first
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got_cache[:, :r], want_cache[:, :r], rtol=tol, atol=1e-5)


def _assert_rotation_equal(got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
    """Bit for bit, or (bf16 under the interpreter) each value want's own or a bf16 neighbour of it."""
    if exact:
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()
        return
    g, w = (x.to(torch.bfloat16).view(torch.int16).int() for x in (got, want))
    assert (g - w).abs().max() <= 1, (got.float() - want.float()).abs().max()


def test_mla_rope_cache_dispatch_keeps_q_and_writes_only_loc(device):
    """The public function on this device: q itself unchanged (the rotation comes back as a new tensor), and
    the result the reference's (on CPU the reference runs; on CUDA the kernel)."""
    from moeserve.kernels.mla_rope_cache import mla_rope_cache

    args = _inputs(9, 16, 64, 16, True, torch.float32, torch.float32, 7, device)
    q_before = args["q_rope"].clone()
    want_cache = args["cache"].clone()
    want_q = mla_rope_cache_reference(**{**args, "cache": want_cache})
    got_q = mla_rope_cache(**args)
    assert torch.equal(args["q_rope"], q_before)
    assert torch.equal(got_q, want_q)
    torch.testing.assert_close(args["cache"], want_cache, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mla_rope_cache_in_a_cuda_graph():
    """Captured once, replayed on new inputs written into the same buffers: the eager kernel's results."""
    from moeserve.kernels.triton_ops.mla_rope_cache import mla_rope_cache

    args = _inputs(33, 16, 512, 64, False, torch.bfloat16, torch.bfloat16, 3, "cuda")
    mla_rope_cache(**{**args, "cache": args["cache"].clone()})  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out = mla_rope_cache(**args)
    fresh = _inputs(33, 16, 512, 64, False, torch.bfloat16, torch.bfloat16, 4, "cuda")
    for k in ("q_rope", "c_kv", "k_rope", "norm_weight", "rope", "loc", "cache"):
        args[k].copy_(fresh[k])
    want_cache = fresh["cache"].clone()
    want_q = mla_rope_cache(**{**fresh, "cache": want_cache})
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(q_out, want_q) and torch.equal(args["cache"], want_cache)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("T, H, interleaved", [(8192, 16, False), (300, 128, True)])  # V2-Lite prefill, V3 heads
def test_mla_rope_cache_real_shapes(T, H, interleaved):
    from moeserve.kernels.triton_ops.mla_rope_cache import mla_rope_cache

    args = _inputs(T, H, 512, 64, interleaved, torch.bfloat16, torch.bfloat16, T + H, "cuda")
    want_cache = args["cache"].clone()
    want_q = mla_rope_cache_reference(**{**args, "cache": want_cache})
    got_q = mla_rope_cache(**args)
    _assert_rotation_equal(got_q, want_q, exact=True)
    _assert_rotation_equal(args["cache"][:, 512:], want_cache[:, 512:], exact=True)
    torch.testing.assert_close(args["cache"][:, :512], want_cache[:, :512], rtol=1.6e-2, atol=1e-5)
