"""MLA's per-layer latent write on one GPU: the fused Triton kernel (kernels/mla_rope_cache.py) beside the sequence
it replaces in DeepSeekAttention.forward (the kv_a_layernorm RMSNorm kernel, RotaryEmbedding.apply on q_rope and
on k_rope, MLAKVPool.set_latent's cat and scatter). V2-Lite's shapes by default (16 heads, latent 512, rope 64,
bf16, YaRN). Each timed under a CUDA graph (triton.testing.do_bench_cudagraph), at T = 1, 64, 256 and 8192 tokens
written to distinct random slots; prints a table and the bytes moved per second, and checks the two agree.

    python benchmark/experiments/bench_mla_rope_cache.py [--heads 16] [--interleaved] [--result-file out.jsonl]
"""

from __future__ import annotations

import argparse
import datetime

import torch
import triton.testing

from moeserve.bench.results import append_results
from moeserve.core.model_config import RopeConfig
from moeserve.kernels.mla_rope_cache import mla_rope_cache
from moeserve.kernels.rms_norm import rms_norm
from moeserve.kvcache.kv_pool import MLAKVPool
from moeserve.layers.rotary import RotaryEmbedding

TOKENS = (1, 64, 256, 8192)
NOPE = 128  # q_nope's width: q_rope is the slice of q after it, as in the model


def _case(T: int, a: argparse.Namespace, dev: torch.device, dt: torch.dtype) -> dict:
    gen = torch.Generator(device=dev).manual_seed(T)
    rope_cfg = RopeConfig(type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=0.707,
                          mscale_all_dim=0.707, interleaved=a.interleaved)
    rotary = RotaryEmbedding(a.rope, rope_cfg)
    page = 64
    pool = MLAKVPool((4 * T) // page + 2, page, 1, a.latent, a.rope, dt, dev)
    q = torch.randn(T, a.heads, NOPE + a.rope, device=dev, generator=gen).to(dt)
    kv = torch.randn(T, a.latent + a.rope, device=dev, generator=gen).to(dt)
    c_kv, k_rope = kv.split([a.latent, a.rope], dim=-1)
    positions = torch.randint(0, 4096, (T,), device=dev, generator=gen)
    loc = page + torch.randperm(pool.num_slots - page, device=dev, generator=gen)[:T]  # page 0 is scratch
    return dict(rotary=rotary, pool=pool, q_rope=q[..., NOPE:], c_kv=c_kv, k_rope=k_rope, rope=rotary(positions),
                loc=loc, weight=(1 + 0.1 * torch.randn(a.latent, device=dev, generator=gen)).to(dt))


def _unfused(c: dict, eps: float) -> torch.Tensor:
    """What DeepSeekAttention.forward ran before: norm, two rotaries, the pool's cat + index_copy_."""
    c_kv = rms_norm(c["c_kv"], c["weight"], eps)
    q_rope = c["rotary"].apply(c["q_rope"], c["rope"])
    k_rope = c["rotary"].apply(c["k_rope"][:, None, :], c["rope"])[:, 0]
    c["pool"].set_latent(0, c["loc"], c_kv, k_rope)
    return q_rope


def _fused(c: dict, eps: float) -> torch.Tensor:
    return mla_rope_cache(c["q_rope"], c["c_kv"], c["k_rope"], c["weight"], eps, c["rope"], c["rotary"].interleaved,
                          c["pool"].get_latent(0), c["loc"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--latent", type=int, default=512)
    ap.add_argument("--rope", type=int, default=64)
    ap.add_argument("--interleaved", action="store_true", help="V3's rope layout (pairs of neighbours)")
    ap.add_argument("--result-file")
    a = ap.parse_args()
    dev, dt, eps = torch.device("cuda"), torch.bfloat16, 1e-6
    device_name, date = torch.cuda.get_device_name(dev), datetime.date.today().isoformat()
    print(f"{device_name}, {date}: heads {a.heads}, latent {a.latent}, rope {a.rope}, "
          f"{'interleaved' if a.interleaved else 'half-split'}, bf16")
    print(f"{'T':>6} {'unfused us':>11} {'fused us':>9} {'speedup':>8} {'fused GB/s':>11} {'q err':>7} {'cache err':>9}")
    rows = []
    for T in TOKENS:
        c = _case(T, a, dev, dt)
        q_want = _unfused(c, eps)
        cache_want = c["pool"].get_latent(0)[c["loc"]].clone()
        c["pool"].get_latent(0).zero_()
        q_got = _fused(c, eps)
        cache_got = c["pool"].get_latent(0)[c["loc"]]
        q_err = (q_got.float() - q_want.float()).abs().max().item()
        cache_err = (cache_got.float() - cache_want.float()).abs().max().item()
        t_unfused = triton.testing.do_bench_cudagraph(lambda: _unfused(c, eps), rep=100)  # noqa: B023
        t_fused = triton.testing.do_bench_cudagraph(lambda: _fused(c, eps), rep=100)  # noqa: B023
        elt = 2
        moved = T * (2 * a.heads * a.rope * elt + 2 * (a.latent + a.rope) * elt + 2 * a.rope * 4 + 8)
        row = {"bench": "mla_rope_cache", "device": device_name, "date": date, "T": T, "heads": a.heads,
               "latent": a.latent, "rope": a.rope, "interleaved": a.interleaved,
               "unfused_us": round(t_unfused * 1e3, 2), "fused_us": round(t_fused * 1e3, 2),
               "speedup": round(t_unfused / t_fused, 2), "fused_GBps": round(moved / (t_fused * 1e-3) / 1e9, 1),
               "max_err_q": q_err, "max_err_cache": cache_err}
        rows.append(row)
        print(f"{T:>6} {row['unfused_us']:>11} {row['fused_us']:>9} {row['speedup']:>8} {row['fused_GBps']:>11} "
              f"{q_err:>7.2g} {cache_err:>9.2g}", flush=True)
    append_results(a.result_file, rows)


if __name__ == "__main__":
    main()
