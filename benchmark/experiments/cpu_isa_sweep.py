"""Where a CPU decode step goes, per kernel build (--cpu-isa) and thread count: the C++ kernels alone, then whole
decode steps with each kernel call timed inside them.

For each ISA the CPU runs (amx, avx512bf16, avx512, avx2) and each --threads count, one subprocess (a process builds one ISA):
  kernels  the tiny V3's shapes (benchmarks/configs/deepseek-v3-tiny-kv512): the routed experts (`cpu_moe_local`,
           16 experts, H 256, I 128, top-4; over packed weights and, in the amx and avx512bf16 builds, the unpacked
           path too) at 1 to 64 tokens;
           MLA decode (4 heads, latent 576, 48 rows per request) at batch 1 to 64; the skinny GEMM at one row.
           Median over rounds of many calls, us per call.
  steps    `bench one-batch`'s rounds (16-token prompts, --output-len new tokens, bf16 dummy weights) at batch 1,
           16 and 64: decode tok/s, and per decode step the ms inside each kernel (experts, MLA decode, skinny
           GEMM, RMSNorm); the rest is torch's own ops and the scheduler.
  python benchmark/experiments/cpu_isa_sweep.py [--threads 1 4 15] [--isa amx amx@1000 avx512] [--output-len 32]
      [--compile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import torch

TINY_V3 = "benchmarks/configs/deepseek-v3-tiny-kv512"
E, H, INTER, TOPK = 16, 256, 128, 4
HEADS, LATENT, V_DIM, ROWS = 4, 576, 512, 48


def _median_us(fn, calls: int, rounds: int) -> float:
    for _ in range(max(1, calls // 4)):
        fn()
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(per)


def kernels(rounds: int) -> dict:
    from moeserve.kernels import cpu_experts, cpu_mla_decode, cpu_skinny_gemm

    gen = torch.Generator().manual_seed(0)
    out: dict = {}
    # experts: weights stored transposed as Experts keeps them on the CPU
    w13 = (torch.randn(E, H, 2 * INTER, generator=gen) * H**-0.5).bfloat16().transpose(1, 2)
    w2 = (torch.randn(E, INTER, H, generator=gen) * INTER**-0.5).bfloat16().transpose(1, 2)
    packed = cpu_experts.pack(w13, w2)
    for T in (1, 4, 16, 64):
        x = torch.randn(T, H, generator=gen).bfloat16()
        ids = torch.stack([torch.randperm(E, generator=gen)[:TOPK] for _ in range(T)])
        wts = torch.rand(T, TOPK, generator=gen)
        if packed is not None:
            out[f"experts packed T={T}"] = _median_us(lambda x=x, ids=ids, wts=wts: cpu_experts.cpu_moe_local(x, ids, wts, w13, w2, packed),
                                                     200, rounds)
        out[f"experts avx T={T}"] = _median_us(
            lambda x=x, ids=ids, wts=wts: cpu_experts.cpu_moe_local(x, ids, wts, w13, w2), 200, rounds)
    cache = torch.randn(64 * ROWS + 8, LATENT, generator=gen).bfloat16()
    for B in (1, 16, 64):
        q = torch.randn(B, HEADS, LATENT, generator=gen).bfloat16()
        idx = torch.randperm(cache.shape[0], generator=gen)[:B * ROWS]
        indptr = torch.arange(B + 1) * ROWS
        out[f"mla_decode B={B}"] = _median_us(
            lambda q=q, idx=idx, indptr=indptr: cpu_mla_decode.mla_decode(q, cache, idx, indptr, V_DIM, 0.1), 200,
            rounds)
    for name, (N, K) in {"kv_a (576, 256)": (576, 256), "gate_up (1024, 256)": (1024, 256),
                         "lm_head (1024, 256)": (1024, 256), "o_proj (256, 128)": (256, 128)}.items():
        w = (torch.randn(N, K, generator=gen) * K**-0.5).bfloat16()
        x = torch.randn(1, K, generator=gen).bfloat16()
        out[f"skinny 1 row {name}"] = _median_us(lambda x=x, w=w: cpu_skinny_gemm.cpu_skinny_gemm(x, w), 400, rounds)
    return out


def steps(isa: str, batch_sizes: list[int], output_len: int, repeat: int, compile_: bool) -> dict:
    """Whole rounds of bench one-batch with every C++ kernel call timed (the kernels' module functions wrapped)."""
    from moeserve.args import ServerArgs
    from moeserve.bench import one_batch
    from moeserve.kernels import cpu_experts, cpu_mla_decode, cpu_rms_norm, cpu_skinny_gemm
    from moeserve.models.default_model import resolve_model_path
    from moeserve.rank.model_runner import ModelRunner

    spent: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)

    def timed(mod, name: str, label: str) -> None:
        fn = getattr(mod, name)

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[label] += time.perf_counter() - t0
                calls[label] += 1
        setattr(mod, name, wrapper)

    timed(cpu_experts, "cpu_moe_local", "experts")
    timed(cpu_experts, "cpu_experts", "experts")
    timed(cpu_mla_decode, "mla_decode", "mla_decode")
    timed(cpu_skinny_gemm, "cpu_skinny_gemm", "skinny")
    timed(cpu_rms_norm, "cpu_rms_norm", "rms_norm")
    args = ServerArgs(model_path=TINY_V3, load_format="dummy", dtype="bfloat16", device="cpu", cpu_isa=isa,
                      enable_torch_compile=compile_)
    resolve_model_path(args)
    one_batch._init_one_rank_group(args)
    runner = ModelRunner(args)
    out = {}
    for bs in batch_sizes:
        one_batch.run_moeserve(args, bs, 16, output_len, 1, repeat=1, runner=runner)  # warm this batch size
        spent.clear()
        calls.clear()
        t0 = time.perf_counter()
        r = one_batch.run_moeserve(args, bs, 16, output_len, 1, warmup=False, repeat=repeat, runner=runner)
        wall = time.perf_counter() - t0
        n_steps = repeat * output_len  # decode steps and the prefill, about one per token
        out[f"bs={bs}"] = {"decode_tok_s": round(r["decode_tok_s"], 1),
                           "ms_per_step": round(wall / n_steps * 1e3, 3),
                           **{f"{k} ms/step": round(v / n_steps * 1e3, 3) for k, v in sorted(spent.items())},
                           **{f"{k} calls/step": round(calls[k] / n_steps, 1) for k in sorted(calls)}}
    return out


def worker(ns) -> None:
    from moeserve.kernels import cpu_experts, cpu_isa

    spec, *options = ns.isa[0].split("+")
    isa, _, tile_from = spec.partition("@")  # amx@N: the experts on tiles from N rows (TILE_FROM_ROWS)
    if tile_from:
        cpu_experts.TILE_FROM_ROWS = int(tile_from)
    from moeserve.kernels import cpu_skinny_gemm

    if "nodense" in options:  # the dense layers on F.linear / the row kernel, not the packed copies
        cpu_skinny_gemm.packed_takes = lambda *a, **k: False
    if "nobmm" in options:  # MLA's per-head products on torch.bmm / the row kernel, not the packed copies
        cpu_skinny_gemm.batched_packed_takes = lambda *a, **k: False
    cpu_isa.select(isa)
    torch.set_num_threads(ns.threads[0])
    res = {"isa": ns.isa[0], "threads": ns.threads[0], "kernels": kernels(ns.rounds)}
    if not ns.kernels_only:
        res["steps"] = steps(isa, ns.batch_size, ns.output_len, ns.repeat, ns.compile)
    print("RESULT " + json.dumps(res), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--isa", nargs="+", default=None,
                   help="default: every ISA the CPU runs; amx@N: the amx build with the experts on tiles from N rows; "
                        "+nodense, +nobmm: without the packed dense / per-head copies; +spin: GOMP_SPINCOUNT=infinite")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 4, 15])
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--kernels-only", action="store_true")
    p.add_argument("--compile", action="store_true", help="the steps with --enable-torch-compile")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.worker:
        return worker(ns)
    from moeserve.kernels import cpu_isa

    isas = ns.isa or list(cpu_isa.supported())
    results = []
    for threads in ns.threads:
        for isa in isas:
            cmd = [sys.executable, __file__, "--worker", "--isa", isa, "--threads", str(threads), "--batch-size",
                   *map(str, ns.batch_size), "--output-len", str(ns.output_len), "--repeat", str(ns.repeat),
                   "--rounds", str(ns.rounds)] + (["--kernels-only"] if ns.kernels_only else []) + (["--compile"] if ns.compile else [])
            env = {**__import__("os").environ, "OMP_NUM_THREADS": str(threads)}
            if "spin" in isa.split("+")[1:]:  # OpenMP's idle threads spin instead of sleeping between regions
                env["GOMP_SPINCOUNT"] = "infinite"
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                print(f"{isa} x{threads}: failed (exit {proc.returncode}): {proc.stderr[-2000:]}", flush=True)
                continue
            res = json.loads(line[len("RESULT "):])
            results.append(res)
            print(json.dumps(res), flush=True)
    # side by side: one table per thread count, a column per ISA
    for threads in ns.threads:
        rows = [r for r in results if r["threads"] == threads]
        if not rows:
            continue
        print(f"\n{threads} thread(s): " + " | ".join(r["isa"] for r in rows))
        for key in dict.fromkeys(k for r in rows for k in r["kernels"]):
            print(f"  {key:32s} " + " ".join(f"{r['kernels'].get(key, float('nan')):9.1f}" for r in rows) + " us")
        for bs in rows[0].get("steps", {}):
            for key in rows[0]["steps"][bs]:
                print(f"  {bs:6s} {key:26s} " + " ".join(f"{r['steps'][bs].get(key, float('nan')):9.3f}"
                                                        for r in rows))


if __name__ == "__main__":
    main()
