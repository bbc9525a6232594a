"""Where an eager prefill step's host stalls come from: Python GC pauses, Triton compiles (or cache loads), the
CUDA caching allocator's device allocations and retries, and the host time of each grouped-GEMM launch.
One model runner; a warm-up round, then one prefill round of distinct random prompts per condition (the cyclic GC
as it is, then with the start-up objects frozen as the serving worker does). Run on the GPU machine:
  python3 scripts/gpu/prefill_stalls.py --model-path benchmarks/configs/deepseek-v2-lite --load-format dummy \
    --dtype bfloat16 --context-length 4096 --mem-fraction-static 0.5 --max-running-requests 256 --batch-size 64
"""

import argparse
import gc
import time
from collections import Counter

import torch

from moeserve.args import ServerArgs
from moeserve.bench.one_batch import run_moeserve
from moeserve.rank.model_runner import ModelRunner

gc_pauses: list[tuple[int, float]] = []
gc_young: list[str] = []  # per collection: its generation's size and commonest types (counted before the clock)
launches: list[float] = []
compiles: list[float] = []
_gc_t0 = [0.0]


def _gc_cb(phase: str, info: dict) -> None:
    if phase == "start":
        objs = gc.get_objects(generation=info["generation"])
        kinds = Counter(type(o).__name__ for o in objs).most_common(5)
        gc_young.append(f"gen {info['generation']}: {len(objs)} objects {kinds}")
        del objs
        _gc_t0[0] = time.perf_counter()
    else:
        ms = (time.perf_counter() - _gc_t0[0]) * 1e3
        gc_pauses.append((info["generation"], ms))
        gc_young[-1] += f", {info['collected']} collected, {ms:.1f} ms"


def _instrument() -> None:
    import triton.runtime.jit as jit

    from moeserve.kernels.triton_ops import moe_gemm as tg

    inner_compile, inner_gemm = jit.JITFunction._do_compile, tg.moe_gemm

    def do_compile(self, *a, **k):
        t = time.perf_counter()
        try:
            return inner_compile(self, *a, **k)
        finally:
            compiles.append((time.perf_counter() - t) * 1e3)

    def gemm(*a, **k):
        t = time.perf_counter()
        try:
            return inner_gemm(*a, **k)
        finally:
            launches.append((time.perf_counter() - t) * 1e3)

    jit.JITFunction._do_compile, tg.moe_gemm = do_compile, gemm
    gc.callbacks.append(_gc_cb)


def _round(args, runner, bs, input_len, tag) -> None:
    for xs in (gc_pauses, gc_young, launches, compiles):
        xs.clear()
    stats = torch.cuda.memory_stats if torch.cuda.is_available() else dict
    s0 = stats()
    r = run_moeserve(args, bs, input_len, 1, seed=7, warmup=False, runner=runner)
    s1 = stats()
    d = {k: s1.get(k, 0) - s0.get(k, 0) for k in ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc",
                                                     "num_device_free")}
    g2 = [ms for g, ms in gc_pauses if g == 2]
    slow = sorted(launches)[-3:]
    print(f"{tag}: prefill {r['prefill_tok_s']:.0f} tok/s | GC {len(gc_pauses)} "
          f"collections, {sum(ms for _, ms in gc_pauses):.1f} ms, full ones {[round(x, 1) for x in g2]} | Triton "
          f"compiles {len(compiles)} ({sum(compiles):.0f} ms) | moe_gemm calls {len(launches)}, slowest "
          f"{[round(x, 2) for x in slow]} ms, median {sorted(launches)[len(launches) // 2] if launches else 0:.3f} ms | allocator {d}",
          flush=True)
    for line in gc_young:
        print(f"  GC {line}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    p.add_argument("--batch-size", type=int, nargs="+", default=[64])
    p.add_argument("--input-len", type=int, default=128)
    ns = p.parse_args()
    args = ServerArgs.from_cli_args(ns)
    runner = ModelRunner(args)
    _instrument()
    for bs in ns.batch_size:
        run_moeserve(args, bs, ns.input_len, 1, seed=3, warmup=False, runner=runner)  # warm-up
        _round(args, runner, bs, ns.input_len, f"bs {bs} gc as is")
        gc.collect()
        gc.freeze()
        _round(args, runner, bs, ns.input_len, f"bs {bs} gc frozen")
        gc.unfreeze()
    gc.callbacks.remove(_gc_cb)


if __name__ == "__main__":
    main()
