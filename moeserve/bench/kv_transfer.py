"""KV transfer benchmark: GB/s of one write of page runs from this process's KV buffers into another process's,
per transfer backend, beside a raw Mooncake transfer of the same bytes as one contiguous region.

    moeserve bench kv-transfer                                  # 256 MiB, DeepSeek-V3-shaped MLA pool, all kinds
    moeserve bench kv-transfer --mib 64 1024 --run-tokens 16 256 --kinds mooncake raw-mooncake

The receiver is a second process on the same machine (loopback TCP). Its KV pool is `--layers` buffers of
[2 * tokens, row_bytes] bytes (row_bytes 1152: DeepSeek's 576-wide bf16 latent), `--page-size` tokens a page; one
write moves `--mib` MiB: runs of `--run-tokens` consecutive tokens from random places of the sender's pool to
random places of the receiver's, in every buffer, i.e. (runs x layers) address ranges in one call. Kinds:
`mooncake` and `zmq` (the backends, through TransferBackend.write), `raw-mooncake` (the engine alone: one
transfer_sync_write of the same number of bytes between two registered contiguous regions, the ceiling of what
the backend can reach). Times are the median of `--iters` writes after `--warmup`; after them the receiver's
pages are compared with the sender's (a checksum per buffer), so a fast but wrong backend does not pass.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import multiprocessing as mp
import random
import statistics
import time
from typing import Any

import torch

from moeserve.bench.results import append_results
from moeserve.disagg.transfer.base import PageRun
from moeserve.disagg.transfer.registry import backend_class

KINDS = ("mooncake", "raw-mooncake", "zmq")


def _pool(layers: int, slots: int, row_bytes: int, seed: int) -> list[torch.Tensor]:
    """`layers` KV buffers [slots, row_bytes] uint8 of random bytes."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (slots, row_bytes), dtype=torch.uint8, generator=g) for _ in range(layers)]


def _runs(num_pages: int, run_pages: int, count: int, rng: random.Random) -> list[PageRun]:
    """`count` runs of `run_pages` pages, at random run-aligned places of two pools of `num_pages` pages."""
    slots = num_pages // run_pages
    src, dst = rng.sample(range(slots), count), rng.sample(range(slots), count)
    return [PageRun(s * run_pages, d * run_pages, run_pages) for s, d in zip(src, dst, strict=True)]


def _checksums(buffers: list[torch.Tensor], pages: list[tuple[int, int]], page_size: int) -> list[int]:
    """Per buffer, the sum of the bytes of the given (first page, count) ranges."""
    return [sum(int(b[p * page_size:(p + n) * page_size].sum(dtype=torch.int64)) for p, n in pages)
            for b in buffers]


# ----------------------------------------------------------------------
# the receiving process
def _receiver(conn: Any, kind: str, layers: int, slots: int, row_bytes: int, page_size: int) -> None:
    if kind == "raw-mooncake":
        _raw_receiver(conn, slots * row_bytes * layers // 2)
        return
    buffers = _pool(layers, slots, row_bytes, seed=1)
    backend = backend_class(kind)(buffers, page_size, host="127.0.0.1")
    conn.send(backend.endpoint())
    while True:
        msg = conn.recv()
        if msg[0] == "open":
            backend.open_window(msg[1], msg[2])  # zmq checks each write against it; mooncake needs none
            conn.send("ok")
        elif msg[0] == "checksums":
            conn.send(_checksums(buffers, msg[1], page_size))
        else:
            break
    backend.close()


def _raw_receiver(conn: Any, nbytes: int) -> None:
    from mooncake.engine import TransferEngine

    region = torch.zeros(nbytes, dtype=torch.uint8)
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert engine.register_memory(region.data_ptr(), nbytes) == 0
    conn.send({"session": f"127.0.0.1:{engine.get_rpc_port()}", "addr": region.data_ptr()})
    conn.recv()
    engine.unregister_memory(region.data_ptr())


# ----------------------------------------------------------------------
def bench_one(kind: str, a: argparse.Namespace, mib: float, run_tokens: int) -> dict:
    run_pages = max(1, run_tokens // a.page_size)
    token_bytes = a.layers * a.row_bytes
    count = max(1, round(mib * 2**20 / (run_pages * a.page_size * token_bytes)))
    tokens = count * run_pages * a.page_size
    slots = 2 * tokens  # room for the runs to land anywhere, not just in order
    if kind == "raw-mooncake":
        importlib.import_module("mooncake.engine")
    else:
        backend_class(kind)  # a ValueError here says what is missing, before a process starts
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(there, kind, a.layers, slots, a.row_bytes, a.page_size),
                       daemon=True)
    proc.start()
    try:
        peer = here.recv()
        if kind == "raw-mooncake":
            times, nbytes, check = _time_raw(peer, tokens * token_bytes, a)
        else:
            times, nbytes, check = _time_backend(kind, peer, here, a, slots, _runs(
                slots // a.page_size, run_pages, count, random.Random(a.seed)))
        here.send(("stop",))
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    t = statistics.median(times)
    return {"bench": "kv_transfer", "kind": kind, "mib": round(nbytes / 2**20, 1), "run_tokens": run_tokens,
            "page_size": a.page_size, "layers": a.layers, "row_bytes": a.row_bytes,
            "ranges": count * a.layers if kind != "raw-mooncake" else 1, "ms": round(t * 1e3, 2),
            "gb_s": round(nbytes / t / 1e9, 3), "verified": check,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")}


def _time_backend(kind: str, peer: dict, conn: Any, a: argparse.Namespace, slots: int,
                  runs: list[PageRun]) -> tuple[list[float], int, bool]:
    buffers = _pool(a.layers, slots, a.row_bytes, seed=2)
    backend = backend_class(kind)(buffers, a.page_size, host="127.0.0.1")
    try:
        backend.check_peer(peer)
        window = "bench"
        conn.send(("open", window, [r.dst_page + i for r in runs for i in range(r.num_pages)]))
        assert conn.recv() == "ok"
        peer = {**peer, "window": window}
        times = []
        for i in range(a.warmup + a.iters):
            start = time.perf_counter()
            nbytes = backend.write(peer, runs, timeout_s=600)
            if i >= a.warmup:
                times.append(time.perf_counter() - start)
        conn.send(("checksums", [(r.dst_page, r.num_pages) for r in runs]))
        ok = conn.recv() == _checksums(buffers, [(r.src_page, r.num_pages) for r in runs], a.page_size)
        return times, nbytes, ok
    finally:
        backend.close()


def _time_raw(peer: dict, nbytes: int, a: argparse.Namespace) -> tuple[list[float], int, bool]:
    from mooncake.engine import TransferEngine

    region = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert engine.register_memory(region.data_ptr(), nbytes) == 0
    times = []
    try:
        for i in range(a.warmup + a.iters):
            start = time.perf_counter()
            rc = engine.transfer_sync_write(peer["session"], region.data_ptr(), peer["addr"], nbytes)
            if rc != 0:
                raise RuntimeError(f"raw mooncake write returned {rc}")
            if i >= a.warmup:
                times.append(time.perf_counter() - start)
    finally:
        engine.unregister_memory(region.data_ptr())
    return times, nbytes, True  # the engine alone: what the backend is checked against


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moeserve bench kv-transfer", description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS, help="What to time (default: all).")
    p.add_argument("--mib", nargs="+", type=float, default=[256.0], help="MiB per write (default: 256).")
    p.add_argument("--run-tokens", nargs="+", type=int, default=[64],
                   help="Tokens per run of consecutive pages: smaller is more fragmented (default: 64).")
    p.add_argument("--page-size", type=int, default=1, help="Tokens per KV page (default: 1, as the server's).")
    p.add_argument("--layers", type=int, default=61, help="KV buffers, one per layer (default: 61).")
    p.add_argument("--row-bytes", type=int, default=1152, help="Bytes per token and layer (default: 1152).")
    p.add_argument("--iters", type=int, default=5, help="Timed writes (default: 5).")
    p.add_argument("--warmup", type=int, default=2, help="Untimed writes first (default: 2).")
    p.add_argument("--seed", type=int, default=0, help="Seed of the run placement (default: 0).")
    p.add_argument("--result-file", default=None, help="Append one JSON line per result to this file.")
    a = p.parse_args(argv)
    rows = []
    print(f"{'kind':>13} {'MiB':>7} {'run_tok':>7} {'ranges':>7} {'ms':>9} {'GB/s':>7}  verified")
    for mib in a.mib:
        for run_tokens in a.run_tokens:
            for kind in a.kinds:
                try:
                    row = bench_one(kind, a, mib, run_tokens)
                except (ImportError, ValueError) as e:
                    print(f"{kind:>13}  not available: {e}")
                    continue
                rows.append(row)
                print(f"{kind:>13} {row['mib']:>7} {run_tokens:>7} {row['ranges']:>7} {row['ms']:>9} "
                      f"{row['gb_s']:>7}  {row['verified']}", flush=True)
    append_results(a.result_file, rows)
    return 0 if all(r["verified"] for r in rows) else 1
