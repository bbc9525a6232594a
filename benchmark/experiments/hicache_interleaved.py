"""Multi-turn TTFT on several servers in one run, interleaved: turn k of every conversation goes to the first
server, then to the second, and so on (the order rotating each turn), one request in flight at a time. A shared
VM's speed drifts by tens of percent over minutes; interleaved, the drift falls on every server alike, where
servers run one after another each got a different machine. Every server gets the same conversations (the
multi-turn dataset of `moeserve bench serving`) and builds each next prompt from its own answers (greedy: the same
text where the servers agree, as the hierarchical cache's servers must).
    python benchmark/experiments/hicache_interleaved.py --server off=http://localhost:31870 \\
        --server host_file=http://localhost:31872 --out /tmp/hicache [--conversations 24 --turns 6 ...]
Per server: `<out>/<name>.json` (bench serving's summary and requests) and a line of the table printed at the end, with
how many of its answers equal the first server's (same conversation and turn); then each server's TTFT p50 per turn
with the median of the prompt tokens it prefilled (not cached), where the TTFT p50 over all turns falls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

from moeserve.bench.datasets import BenchRequest, multiturn_conversations
from moeserve.bench.serving import BACKENDS, RequestResult, send_request, summarize, wait_ready
from moeserve.text.tokenizer import load_tokenizer


async def run(servers: dict[str, str], conversations, tokenizer) -> dict[str, list[RequestResult]]:
    import aiohttp

    endpoint, kind = BACKENDS["moeserve"]
    results: dict[str, list[RequestResult]] = {name: [] for name in servers}
    answers: dict[str, list[list[str]]] = {name: [[] for _ in conversations] for name in servers}
    names = list(servers)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        for name, url in servers.items():  # warm-up on a prompt no conversation shares
            warm = await send_request(session, url + endpoint, kind, None, BenchRequest("Hello", 1, 16))
            if not warm.success:
                raise RuntimeError(f"{name}: the warm-up request failed: {warm.error}")
        for turn in range(len(conversations[0].user_messages)):
            for name in names[turn % len(names):] + names[: turn % len(names)]:
                for conv, said in zip(conversations, answers[name], strict=True):
                    if len(said) < turn:  # an earlier turn failed: its next prompts do not exist (as bench serving)
                        results[name].append(RequestResult(expected_output_len=conv.output_len, turn=turn + 1,
                                                           error="not sent: an earlier turn of its conversation "
                                                                 "failed"))
                        continue
                    req = conv.turn_request(tokenizer, said)
                    res = await send_request(session, servers[name] + endpoint, kind, None, req)
                    results[name].append(res)
                    if res.success:
                        said.append(res.output_text)
    return results, answers


def same_answers(mine: list[list[str]], first: list[list[str]]) -> tuple[int, int]:
    """(answers equal to the first server's at the same conversation and turn, answers compared)."""
    pairs = [(a, b) for x, y in zip(mine, first, strict=True) for a, b in zip(x, y, strict=False)]
    return sum(a == b for a, b in pairs), len(pairs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", action="append", required=True, help="NAME=URL (repeat; the first is the baseline)")
    p.add_argument("--out", required=True)
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    servers = dict(s.split("=", 1) for s in args.server)
    for url in servers.values():
        wait_ready(url, "moeserve", 300)
    with urllib.request.urlopen(next(iter(servers.values())) + "/get_model_info", timeout=30) as r:
        tokenizer = load_tokenizer(json.load(r)["tokenizer_path"])
    conversations = multiturn_conversations(tokenizer, args.conversations, args.turns, args.system_len,
                                            args.user_len, args.output_len, args.seed)
    start = time.perf_counter()
    results, answers = asyncio.run(run(servers, conversations, tokenizer))
    print(f"{len(servers)} servers interleaved, {args.conversations} conversations x {args.turns} turns, "
          f"{time.perf_counter() - start:.0f} s")
    names = list(servers)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = None
    print(f"{'server':<10} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'input tok/s':>12} {'cached':>8} {'failed':>7} "
          f"{'p50 vs first':>13} {'same answers':>13}")
    for name, res in results.items():
        busy = sum(r.latency for r in res if r.success)  # its requests' wall time (one in flight at a time)
        s = summarize(res, busy)
        (out / f"{name}.json").write_text(json.dumps(
            {"config": {**vars(args), "server": servers[name]}, "summary": s,
             "requests": [{k: v for k, v in asdict(r).items() if k != "output_text"} for r in res]}, indent=1))
        p50 = s["ttft_ms"]["median"]
        base = base or p50
        same, compared = same_answers(answers[name], answers[names[0]])
        print(f"{name:<10} {p50:>12.1f} {s['ttft_ms']['p99']:>12.1f} {s['input_throughput']:>12.1f} "
              f"{100 * s['cached_token_rate']:>7.1f}% {s['failed']:>7} {base / p50:>12.2f}x {same:>6}/{compared}")
    print("TTFT p50 ms by turn (new tokens p50: the prompt tokens not cached)")
    for name, res in results.items():
        print(f"{name:<10} " + "  ".join(per_turn(res, turn) for turn in range(1, args.turns + 1)))


def per_turn(results: list[RequestResult], turn: int) -> str:
    """One turn's TTFT p50 and the p50 of its prefilled (not cached) prompt tokens, over the successful requests."""
    done = [r for r in results if r.success and r.turn == turn]
    if not done:
        return "-"
    ttft = statistics.median(1e3 * r.ttft for r in done)
    new = statistics.median(r.prompt_len - r.cached_tokens for r in done)
    return f"{ttft:.1f} ({new:.0f})"


if __name__ == "__main__":
    main()
