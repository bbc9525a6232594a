"""The side-by-side table of `moeserve bench pd`: one column per run (colocated, PD per transfer backend)."""

from __future__ import annotations

import argparse
import math
from typing import Any

# (row title, how to read it from one run's result); None when the run has no such number (PD rows, colocated)
_ROWS: list[tuple[str, Any]] = [
    ("Successful requests", lambda r: r["summary"]["completed"]),
    ("Failed requests", lambda r: r["summary"]["failed"]),
    ("Duration (s)", lambda r: r["summary"]["duration_s"]),
    ("Request throughput (req/s)", lambda r: r["summary"]["request_throughput"]),
    ("Output throughput (tok/s)", lambda r: r["summary"]["output_throughput"]),
    ("TTFT p50 (ms)", lambda r: r["summary"]["ttft_ms"]["median"]),
    ("TTFT p99 (ms)", lambda r: r["summary"]["ttft_ms"]["p99"]),
    ("ITL p50 (ms)", lambda r: r["summary"]["itl_ms"]["median"]),
    ("ITL p99 (ms)", lambda r: r["summary"]["itl_ms"]["p99"]),
    ("TPOT p50 (ms)", lambda r: r["summary"]["tpot_ms"]["median"]),
    ("E2E p50 (ms)", lambda r: r["summary"]["e2e_ms"]["median"]),
    ("KV transfers", lambda r: _transfer(r, "transfers")),
    ("KV transferred (MiB)", lambda r: _transfer(r, "mib")),
    ("KV latency incl. queue, mean ms", lambda r: _transfer(r, "mean_latency_ms")),
    ("KV write time, mean (ms)", lambda r: _transfer(r, "mean_write_ms")),
    ("KV GB/s inside the writes", lambda r: _sig(_transfer(r, "gb_s_while_writing"))),
    ("KV transfer failures", lambda r: _transfer(r, "failed")),
    ("Load average 1 min, start/end", lambda r: "/".join(f"{x:.1f}" for x in r["loadavg_1m"])),
]


def _transfer(run: dict[str, Any], key: str) -> Any:
    t = run.get("transfer")
    return None if t is None else t["summary"][key]


def _sig(value: float | None) -> str | None:
    """Three significant digits: GB/s spans 0.0001 (CPU, tiny model) to tens (GPU)."""
    return None if value is None else f"{value:.3g}"


def transfer_summary(prefill: dict[str, float], duration_s: float) -> dict[str, Any]:
    """From the prefill server's counter growth over a run (transfers, transfer_bytes, transfer_seconds: the sum
    of each request's time from decode's destination to its last write, write_seconds: the sum of the time inside
    the backend's writes, failed): what the table shows.

    Only bytes over the time inside the writes is a bandwidth. The latency from decode's destination to the last
    write holds the prompt's queueing and prefill, so bytes over it (or over the whole run) measure how busy the
    servers were, not the link: the table shows that latency as a latency."""
    n, nbytes, seconds = int(prefill["transfers"]), prefill["transfer_bytes"], prefill["transfer_seconds"]
    writing = prefill["write_seconds"]
    return {"transfers": n, "failed": int(prefill["failed"]), "mib": round(nbytes / 2**20, 2),
            "mean_latency_ms": round(seconds / n * 1e3, 2) if n else 0.0,
            "mean_write_ms": round(writing / n * 1e3, 3) if n else 0.0,
            "gb_s_while_writing": round(nbytes / writing / 1e9, 6) if writing else 0.0}


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def side_by_side(results: dict[str, dict[str, Any]], bench: argparse.Namespace) -> str:
    """The table: a row per number, a column per run in the order run ('colocated', 'zmq' = PD over zmq, ...)."""
    names = [n if n == "colocated" else f"PD {n}" for n in results]
    width = max(12, *(len(n) + 2 for n in names))
    rate = "inf" if math.isinf(bench.request_rate) else f"{bench.request_rate:g}"
    shape = (f", input {bench.random_input_len}, output {bench.random_output_len}, range ratio "
             f"{bench.random_range_ratio:g}" if bench.dataset == "random" else "")
    head = (f"PD vs colocated: {bench.num_prompts} prompts, dataset {bench.dataset}{shape}, concurrency "
            f"{bench.max_concurrency or 'unbounded'}, rate {rate}")
    lines = [head, f"{'':<32}" + "".join(f"{n:>{width}}" for n in names)]
    for title, get in _ROWS:
        lines.append(f"{title:<32}" + "".join(f"{_cell(get(r)):>{width}}" for r in results.values()))
    lines.append("KV latency: prefill's count, from decode's destination to the last write, so it holds the "
                 "prompt's queueing and prefill; KV GB/s: bytes over the time inside the backend's writes only")
    return "\n".join(lines)
