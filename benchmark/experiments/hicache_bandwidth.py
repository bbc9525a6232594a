"""The host KV tier's copy bandwidth: CopyEngine.backup (device -> host, waited for) and HostKVPool.load
(host -> device) of N random token slots of DeepSeek-V3's latent cache (61 layers x 576 bf16 per token), timed
with the device synchronized; and how long backup takes to return (the scheduler's thread's share of it).

    python3 benchmark/experiments/hicache_bandwidth.py [--device cuda] [--tokens 4096 32768] [--layers 61]

Prints one JSON line per size: GB/s each way (the bytes of every layer's rows over the wall time), and
to_host_queue_ms: the time backup took to return."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from moeserve.kvcache.copy_engine import CopyEngine
from moeserve.kvcache.host_pool import HostKVPool
from moeserve.kvcache.kv_pool import MLAKVPool


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    device = torch.device(a.device)
    pages = max(a.tokens) // a.page_size + 1
    pool = MLAKVPool(pages, a.page_size, a.layers, 512, 64, torch.bfloat16, device)
    for b in pool.buffers:
        b.normal_()  # random bytes: nothing special about zeros
    host = HostKVPool(pool, pages)
    copies = CopyEngine(host)
    rng = np.random.default_rng(0)
    for n in a.tokens:
        # whole pages in a random order, as an evicted radix node's pages are
        order = rng.permutation(np.arange(1, pages + 1))[:n // a.page_size]
        dev_slots = (order[:, None] * a.page_size + np.arange(a.page_size)).reshape(-1).astype(np.int64)
        host_slots = host.alloc(len(dev_slots))
        times = {"to_host": [], "to_host_queue": [], "to_device": []}
        for _ in range(a.repeat):
            _sync(device)
            t0 = time.perf_counter()
            handle = copies.backup(dev_slots, host_slots)
            times["to_host_queue"].append(time.perf_counter() - t0)
            handle.wait()
            times["to_host"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            host.load(host_slots, dev_slots)
            _sync(device)
            times["to_device"].append(time.perf_counter() - t0)
        host.free(host_slots)
        nbytes = len(dev_slots) * host.bytes_per_token
        print(json.dumps({"device": str(device), "tokens": len(dev_slots), "layers": a.layers, "mib": nbytes / 2**20,
                          **{f"{k}_gb_s": nbytes / min(times[k]) / 1e9 for k in ("to_host", "to_device")},
                          **{f"{k}_ms": 1e3 * min(v) for k, v in times.items()}}), flush=True)
    copies.close()


if __name__ == "__main__":
    main()
