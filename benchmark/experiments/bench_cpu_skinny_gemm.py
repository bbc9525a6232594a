"""The CPU bf16 skinny GEMM (moeserve/kernels/cpu_skinny_gemm.py) beside torch's F.linear in bf16 and in float32,
at 1 to 4 rows, in one process: each round times the three once each, in turn (so a busy shared machine slows all
three alike), many calls a round; the median per call over the rounds, and the ratios. Each output is checked
against the float32 product first. Shapes (N, K): the tiny V3 (benchmarks/configs/deepseek-v3-tiny-kv512) that
`moeserve bench cpu-compare` runs, and DeepSeek-V2-Lite's o_proj and kv_a_proj.
  python benchmark/experiments/bench_cpu_skinny_gemm.py [--isa avx2] [--threads 1] [--rounds 30]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from moeserve.kernels import cpu_isa, cpu_skinny_gemm

SHAPES = {"tiny.kv_a": (576, 256), "tiny.q_b": (384, 64), "tiny.o_proj": (256, 128), "tiny.mlp.gate_up": (1024, 256),
          "tiny.mlp.down": (256, 512), "tiny.lm_head": (1024, 256), "v2lite.kv_a": (576, 2048),
          "v2lite.o_proj": (2048, 2048)}


def _per_call_us(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--isa", default="auto", choices=cpu_isa.CHOICES)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--calls", type=int, default=200, help="calls per op and round")
    ns = p.parse_args()
    cpu_isa.select(ns.isa)
    torch.set_num_threads(ns.threads)
    print(f"ISA {cpu_isa.current()} (dot products in bf16: {cpu_skinny_gemm.uses_dpbf16()}), {ns.threads} thread(s), "
          f"torch {torch.__version__}, median of {ns.rounds} rounds of {ns.calls} calls, us per call")
    print("| shape (N, K) | rows | kernel | F.linear bf16 | F.linear fp32 | bf16 / kernel | kernel / fp32 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for name, (N, K) in SHAPES.items():
        w = (torch.randn(N, K, generator=gen) * K**-0.5).bfloat16()
        wf = w.float()
        for rows in range(1, cpu_skinny_gemm.MAX_ROWS + 1):
            x = torch.randn(rows, K, generator=gen).bfloat16()
            xf = x.float()
            assert cpu_skinny_gemm.takes(x, w)
            torch.testing.assert_close(cpu_skinny_gemm.cpu_skinny_gemm(x, w).float(), xf @ wf.T, rtol=2e-2, atol=2e-2)
            ops = {"kernel": lambda x=x, w=w: cpu_skinny_gemm.cpu_skinny_gemm(x, w),
                   "bf16": lambda x=x, w=w: F.linear(x, w), "fp32": lambda xf=xf, wf=wf: F.linear(xf, wf)}
            times: dict[str, list[float]] = {k: [] for k in ops}
            for fn in ops.values():  # warm-up
                _per_call_us(fn, ns.calls // 4)
            for _ in range(ns.rounds):
                for k, fn in ops.items():
                    times[k].append(_per_call_us(fn, ns.calls))
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"| {name} ({N}, {K}) | {rows} | {med['kernel']:.1f} | {med['bf16']:.1f} | {med['fp32']:.1f} | "
                  f"{med['bf16'] / med['kernel']:.2f}x | {med['kernel'] / med['fp32']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
