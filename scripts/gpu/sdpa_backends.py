"""Host cost of one SDPA call at MLA's prefill shapes (q/k head 192, v head 128, 16 heads, causal) per backend, with
a new sequence length each call (as serving's prefills have) and with one length; then a 64-element CPU
repeat_interleave with torch's default thread pool and with one thread. On the GPU machine:
  python3 scripts/gpu/sdpa_backends.py
"""

import contextlib
import random
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def run(label: str, ctx, n: int = 20, same: bool = False) -> None:
    times = []
    for _ in range(n):
        length = 512 if same else random.randint(256, 768)
        q = torch.randn(1, 16, length, 192, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 16, length, 192, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, 16, length, 128, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with ctx():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.1)
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        times.append((host * 1e3, (time.perf_counter() - t0) * 1e3))
    times = times[2:]
    hosts, walls = sorted(a for a, _ in times), sorted(b for _, b in times)
    print(f"{label}: host median {hosts[len(hosts) // 2]:.2f} ms, max {hosts[-1]:.2f}, wall median "
          f"{walls[len(walls) // 2]:.2f} ms", flush=True)


def main() -> None:
    run("default backends, a new length each call", contextlib.nullcontext)
    run("default backends, one length", contextlib.nullcontext, same=True)
    run("EFFICIENT, a new length each call", lambda: sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]))
    run("MATH, a new length each call", lambda: sdpa_kernel([SDPBackend.MATH]))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run("default backends (profiled)", contextlib.nullcontext, n=4)
    print("kernels:", [e.key for e in prof.key_averages() if any(w in e.key.lower() for w in ("attention", "fmha",
                                                                                              "cudnn", "sdpa"))][:6])
    x, r = torch.arange(64), torch.ones(64, dtype=torch.int64)
    for threads in (torch.get_num_threads(), 1):
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        for _ in range(200):
            torch.repeat_interleave(x, r)
        print(f"repeat_interleave on the CPU, {threads} threads: {(time.perf_counter() - t0) / 200 * 1e6:.1f} us")


if __name__ == "__main__":
    main()
