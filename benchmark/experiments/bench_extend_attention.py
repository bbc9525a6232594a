"""Prefill (extend) attention at MLA's shapes (16 heads, q/k 128 + rope 64, v 128) on one GPU: the Triton kernel
(kernels/extend_attention.py, several launch configurations) beside what it replaced (the rope parts concatenated,
then SDPA's EFFICIENT kernel over the padded groups of layers/attention/ops.py) and beside SDPA's cuDNN and FLASH
(V padded to 192) kernels on the dense batch, in device time (triton.testing.do_bench, median). Every case is checked
against a float32 SDPA first. Run on the GPU machine:
  python3 benchmark/experiments/bench_extend_attention.py [--result-file F]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from moeserve.bench.results import append_results
from moeserve.kernels.extend_attention import extend_attention_reference, extend_seqs
from moeserve.kernels.triton_ops.extend_attention import default_config, extend_attention
from moeserve.layers.attention.extend_plan import ExtendPlan
from moeserve.layers.attention.ops import extend_attention as ops_extend_attention

H, D, R, DV = 16, 128, 64, 128
CONFIGS = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3), (128, 128, 8, 2),
           (64, 32, 4, 3)]
CASES = {"4 x 2048": ([2048] * 4, [2048] * 4), "1 x 512": ([512], [512]), "1 x 8192": ([8192], [8192]),
         "2048 over 6144 cached + 3 x 512": ([2048, 512, 512, 512], [8192, 512, 512, 512]),
         "32 x 128..768": (None, None)}


def device_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def bench_case(name: str, ext: list[int] | None, seq_lens: list[int] | None, gen: torch.Generator) -> dict:
    if ext is None:  # serving-like: distinct lengths, no prefix
        ext = seq_lens = torch.randint(128, 769, (32,), generator=gen).tolist()
    T, S = sum(ext), sum(seq_lens)
    dev = "cuda"
    q = torch.randn(T, H, D, generator=gen).to(dev, torch.bfloat16)
    q_rope = torch.randn(T, H, R, generator=gen).to(dev, torch.bfloat16)
    kv = torch.randn(S, H, D + DV, generator=gen).to(dev, torch.bfloat16)
    k, v = kv[..., :D], kv[..., D:]
    k_rope = torch.randn(S, R, generator=gen).to(dev, torch.bfloat16)
    seqs = extend_seqs(ext, seq_lens, dev)
    scale = (D + R) ** -0.5
    pairs = sum(n * s - n * (n - 1) // 2 for n, s in zip(ext, seq_lens, strict=True))  # (query, key) seen
    flops = 2 * pairs * H * (D + R + DV)
    ref = extend_attention_reference(q.float(), k.float(), v.float(), seqs, max(ext), scale, q_rope.float(),
                                     k_rope.float())
    res = {"case": name, "tokens": T, "tflop": flops / 1e12}

    def report(label, fn, check=True):
        try:
            out = fn()
        except (RuntimeError, ValueError) as e:
            print(f"{name:34s} {label:28s} refused: {str(e).splitlines()[0][:70]}", flush=True)
            return
        err = (out.float() - ref).abs().max().item() if check else float("nan")
        ms = device_ms(fn)
        res[label] = ms
        print(f"{name:34s} {label:28s} {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s  max err {err:.3g}",
              flush=True)

    for cfg in CONFIGS:
        tag = "triton " + "/".join(map(str, cfg)) + (" (default)" if cfg == default_config(D, R, DV,
                                                                                           q.dtype, max(ext)) else "")
        report(tag, lambda cfg=cfg: extend_attention(q, k, v, seqs, max(ext), scale, q_rope, k_rope,
                                                     config=cfg))
    plan = ExtendPlan.build(ext, seq_lens, dev)  # the padded groups (what ran before on CUDA)
    report("cat + SDPA groups (before)", lambda: ops_extend_attention(q, k, v, ext, seq_lens, scale, plan=plan,
                                                                      q_rope=q_rope, k_rope=k_rope))
    if len(set(ext)) == 1 and ext == seq_lens:  # one dense batch: SDPA's other kernels, inputs prebuilt
        B, L = len(ext), ext[0]
        qd = torch.cat((q, q_rope), -1).view(B, L, H, D + R).transpose(1, 2)
        kd = torch.cat((k, k_rope[:, None].expand(-1, H, -1)), -1).view(B, L, H, D + R).transpose(1, 2)
        vd = v.reshape(B, L, H, DV).transpose(1, 2)
        vp = F.pad(vd, (0, D + R - DV))

        def sdpa(backend, vv, cut):
            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(qd, kd, vv, is_causal=True, scale=scale)
            return o[..., :cut].transpose(1, 2).reshape(T, H, DV)

        report("SDPA cuDNN (dense)", lambda: sdpa(SDPBackend.CUDNN_ATTENTION, vd, DV))
        report("SDPA EFFICIENT (dense)", lambda: sdpa(SDPBackend.EFFICIENT_ATTENTION, vd, DV))
        report("SDPA FLASH, V padded", lambda: sdpa(SDPBackend.FLASH_ATTENTION, vp, DV))
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--result-file")
    ns = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = [bench_case(name, ext, seq_lens, gen) for name, (ext, seq_lens) in CASES.items()]
    append_results(ns.result_file, rows)


if __name__ == "__main__":
    main()
