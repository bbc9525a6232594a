"""`moeserve bench serving`: an online load generator for moeserve, SGLang or any OpenAI-compatible server.

It sends streamed requests (Poisson arrivals at --request-rate, or all at once with inf; at most
--max-concurrency in flight) and measures, per request, TTFT (send -> first token), ITL (gaps between streamed
chunks), TPOT ((E2E - TTFT) / (output tokens - 1)) and E2E latency, as SGLang's and vLLM's bench_serving do.
Output lengths are exact (ignore_eos). It prints a table and can write every number to --output-file (JSON).

    moeserve bench serving --port 30000 --dataset random --random-input-len 512 --random-output-len 128 \\
        --num-prompts 200 --request-rate 16 --max-concurrency 64 --output-file result.json

`--dataset multiturn` runs conversations instead (a prefix-cache workload: each turn's prompt is the history so
far): a conversation's turns go in order, turn k+1 sent when turn k's answer has arrived and holding that answer's
text, while conversations interleave (they start at --request-rate, and --max-concurrency bounds the requests in
flight). Per turn it reports TTFT and the prompt tokens the server says it had cached (meta_info's cached_tokens,
or usage.prompt_tokens_details; 0 where the server does not say).

    moeserve bench serving --port 30000 --dataset multiturn --multiturn-num-conversations 32 --multiturn-turns 4 \\
        --multiturn-system-prompt-len 256 --multiturn-user-len 128 --multiturn-output-len 32 --max-concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from moeserve.bench.datasets import (
    BenchRequest,
    Conversation,
    multiturn_conversations,
    random_requests,
    served_prompt_len,
    shared_prefix_requests,
    sharegpt_requests,
)
from moeserve.help_text import DefaultsOnceHelpFormatter
from moeserve.plotting import MISSING, have_matplotlib

BACKENDS = {  # name -> (endpoint, kind)
    "moeserve": ("/generate", "native"),
    "sglang": ("/generate", "native"),
    "openai": ("/v1/completions", "completions"),
    "openai-chat": ("/v1/chat/completions", "chat"),
}
DATASETS = ("random", "sharegpt", "generated-shared-prefix", "multiturn")


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds, send -> last byte
    sent_s: float = 0.0  # when it was sent, seconds since the run began
    itl: list[float] = field(default_factory=list)  # seconds between streamed chunks
    error: str = ""
    expected_output_len: int = 0
    spec_verify_ct: int | None = None  # native API with speculative decoding: the request's verify steps
    cached_tokens: int = 0  # prompt tokens the server reports it had cached (0 where it does not say)
    turn: int = 0  # a multi-turn conversation's turn (1-based); 0 for single requests
    output_text: str = ""  # the answer (a multi-turn conversation's next prompt holds it)


# ----------------------------------------------------------------------
# one request
def _payload(kind: str, model: str | None, req: BenchRequest, ignore_eos: bool, extra: dict) -> dict:
    if kind == "native":
        return {"text": req.prompt, "stream": True,
                "sampling_params": {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": ignore_eos,
                                    **extra}}
    body: dict[str, Any] = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
                            "ignore_eos": ignore_eos, "stream_options": {"include_usage": True}, **extra}
    if kind == "chat":
        body["messages"] = req.messages or [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


async def send_request(session: Any, url: str, kind: str, model: str | None, req: BenchRequest,
                       ignore_eos: bool = True, extra: dict | None = None,
                       headers: dict | None = None) -> RequestResult:
    """Send one streamed request and time it; never raises (failures are recorded in the result)."""
    res = RequestResult(prompt_len=req.prompt_len, expected_output_len=req.output_len, turn=req.turn)
    body = _payload(kind, model, req, ignore_eos, extra or {})
    start = time.perf_counter()
    res.sent_s = start  # run_benchmark makes it relative to the run's start
    last = start
    tokens_seen = 0
    usage_tokens = None
    text_parts: list[str] = []
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                if "error" in ev:
                    res.error = str(ev["error"].get("message", ev["error"]))[:300]
                    return res
                now = time.perf_counter()
                if kind == "native":
                    new = ev["meta_info"]["completion_tokens"] - tokens_seen
                    tokens_seen = ev["meta_info"]["completion_tokens"]
                    if ev["meta_info"].get("prompt_tokens"):
                        res.prompt_len = ev["meta_info"]["prompt_tokens"]
                    res.spec_verify_ct = ev["meta_info"].get("spec_verify_ct", res.spec_verify_ct)
                    res.cached_tokens = int(ev["meta_info"].get("cached_tokens") or 0)
                    text_parts = [ev.get("text", "")]  # the text so far
                else:
                    if ev.get("usage"):
                        usage_tokens = ev["usage"].get("completion_tokens")
                        res.prompt_len = ev["usage"].get("prompt_tokens") or res.prompt_len
                        details = ev["usage"].get("prompt_tokens_details") or {}
                        res.cached_tokens = int(details.get("cached_tokens") or 0)
                    choices = ev.get("choices") or []
                    text = ""
                    for ch in choices:
                        if kind == "chat":
                            text += (ch.get("delta") or {}).get("content") or ""
                        else:
                            text += ch.get("text") or ""
                    text_parts.append(text)
                    new = 1 if text else 0
                    tokens_seen += new
                if new <= 0:
                    continue
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
        res.latency = time.perf_counter() - start
        res.output_len = usage_tokens if usage_tokens is not None else tokens_seen
        res.output_text = "".join(text_parts)
        res.success = res.ttft > 0.0 or req.output_len == 0
        if not res.success:
            res.error = "the stream ended without any output"
    except Exception as e:  # noqa: BLE001 - a benchmark records failures and goes on
        res.error = f"{type(e).__name__}: {e}"[:300]
    return res


# ----------------------------------------------------------------------
# the run
async def _arrivals(items: list, rate: float, rng: random.Random):
    for i, item in enumerate(items):
        yield item
        if math.isfinite(rate) and rate > 0 and i < len(items) - 1:
            await asyncio.sleep(rng.expovariate(rate))


async def run_benchmark(base_url: str, backend: str, model: str | None, reqs: list[BenchRequest] | list[Conversation],
                        request_rate: float = math.inf, max_concurrency: int | None = None, seed: int = 0,
                        ignore_eos: bool = True, extra: dict | None = None, api_key: str | None = None,
                        warmup_requests: int = 1, show_progress: bool = True,
                        tokenizer: Any = None) -> tuple[list[RequestResult], float]:
    """Run all requests, or all conversations (their turns in order; `tokenizer` counts their prompts); returns the
    results (in request order, a conversation's turns together) and the duration in seconds."""
    import aiohttp
    from tqdm import tqdm

    endpoint, kind = BACKENDS[backend]
    url = base_url.rstrip("/") + endpoint
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, force_close=False)
    conversations = [c for c in reqs if isinstance(c, Conversation)]
    assert not conversations or tokenizer is not None, "conversations need the tokenizer"
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        # A conversation's own prompt would be cached by its warm-up: those warm up on an unrelated one.
        warmups = ([BenchRequest("Hello", 1, c.output_len) for c in conversations] if conversations else reqs)
        for req in warmups[:warmup_requests]:
            warm = await send_request(session, url, kind, model, BenchRequest(req.prompt, req.prompt_len,
                                                                               min(req.output_len, 16)),
                                      ignore_eos, extra, headers)
            if not warm.success:
                raise RuntimeError(f"the warm-up request failed: {warm.error}")

        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        total = sum(len(c.user_messages) for c in conversations) if conversations else len(reqs)
        progress = tqdm(total=total, disable=not show_progress, desc="requests", unit="req")

        async def one(req: BenchRequest) -> RequestResult:
            if sem is None:
                res = await send_request(session, url, kind, model, req, ignore_eos, extra, headers)
            else:
                async with sem:
                    res = await send_request(session, url, kind, model, req, ignore_eos, extra, headers)
            progress.update(1)
            return res

        async def conversation(conv: Conversation) -> list[RequestResult]:
            answers: list[str] = []
            results: list[RequestResult] = []
            for turn in range(1, len(conv.user_messages) + 1):
                res = await one(await asyncio.to_thread(conv.turn_request, tokenizer, answers))
                results.append(res)
                if not res.success:  # the next turns need this answer: counted as failed, not sent
                    skipped = range(turn + 1, len(conv.user_messages) + 1)
                    results += [RequestResult(expected_output_len=conv.output_len, turn=t,
                                              error="not sent: an earlier turn of its conversation failed")
                                for t in skipped]
                    progress.update(len(skipped))
                    break
                answers.append(res.output_text)
            return results

        rng = random.Random(seed)
        start = time.perf_counter()
        if conversations:
            tasks = [asyncio.create_task(conversation(c)) async for c in _arrivals(conversations, request_rate, rng)]
            results = [r for conv_results in await asyncio.gather(*tasks) for r in conv_results]
        else:
            tasks = [asyncio.create_task(one(req)) async for req in _arrivals(reqs, request_rate, rng)]
            results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        for res in results:
            res.sent_s -= start
        progress.close()
    return results, duration


# ----------------------------------------------------------------------
# statistics
def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    ordered = sorted(values)

    def pct(p: float) -> float:
        # linear interpolation between closest ranks, as numpy.percentile's default
        k = (len(ordered) - 1) * p / 100.0
        lo, hi = math.floor(k), math.ceil(k)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean": statistics.fmean(values) * scale, "median": pct(50) * scale,
            "std": (statistics.pstdev(values) if len(values) > 1 else 0.0) * scale,
            "p90": pct(90) * scale, "p99": pct(99) * scale, "max": ordered[-1] * scale}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """The benchmark's numbers: throughputs and latency statistics (milliseconds) over successful requests."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            errors[r.error] = errors.get(r.error, 0) + 1
    total_cached = sum(r.cached_tokens for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:10]),
        "output_len_mismatches": sum(1 for r in ok if r.output_len != r.expected_output_len),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_cached_tokens": total_cached,
        "cached_token_rate": total_cached / total_in if total_in else 0.0,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "input_throughput": total_in / duration if duration else 0.0,
        "output_throughput": total_out / duration if duration else 0.0,
        "total_throughput": (total_in + total_out) / duration if duration else 0.0,
        "concurrency": sum(r.latency for r in ok) / duration if duration else 0.0,
        "e2e_ms": _stats([r.latency for r in ok]),
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpots),
        "itl_ms": _stats([g for r in ok for g in r.itl]),
        "accept_length": _accept_length(ok),
        "turns": per_turn(results),
    }


def _accept_length(ok: list[RequestResult]) -> float | None:
    """Speculative decoding (native API): output tokens per verify step over all requests (SGLang's per-request
    completion_tokens / spec_verify_ct, pooled); None without it."""
    spec = [r for r in ok if r.spec_verify_ct]
    return sum(r.output_len for r in spec) / sum(r.spec_verify_ct for r in spec) if spec else None


def per_turn(results: list[RequestResult]) -> list[dict[str, Any]]:
    """Per turn of multi-turn conversations (empty for single requests): requests, prompt and cached tokens, TTFT."""
    out = []
    for turn in sorted({r.turn for r in results if r.turn > 0}):
        of_turn = [r for r in results if r.turn == turn]
        ok = [r for r in of_turn if r.success]
        prompt = sum(r.prompt_len for r in ok)
        cached = sum(r.cached_tokens for r in ok)
        out.append({"turn": turn, "completed": len(ok), "failed": len(of_turn) - len(ok),
                    "prompt_tokens_mean": prompt / len(ok) if ok else 0.0,
                    "cached_tokens_mean": cached / len(ok) if ok else 0.0,
                    "cached_token_rate": cached / prompt if prompt else 0.0,
                    "ttft_ms": _stats([r.ttft for r in ok])})
    return out


def format_report(summary: dict[str, Any], backend: str, request_rate: float, max_concurrency: int | None) -> str:
    w = 50
    lines = [" Serving Benchmark Result ".center(w, "=")]

    def row(name: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{name:<40}{text:>10}")

    row("Backend:", backend)
    row("Traffic request rate:", "inf" if math.isinf(request_rate) else f"{request_rate:g}")
    row("Max request concurrency:", max_concurrency if max_concurrency else "not set")
    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Benchmark duration (s):", summary["duration_s"])
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Total cached prompt tokens:", summary["total_cached_tokens"])
    row("Cached prompt tokens (%):", 100.0 * summary["cached_token_rate"])
    row("Request throughput (req/s):", summary["request_throughput"])
    row("Input token throughput (tok/s):", summary["input_throughput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total token throughput (tok/s):", summary["total_throughput"])
    row("Concurrency:", summary["concurrency"])
    if summary.get("accept_length") is not None:
        row("Accept length:", summary["accept_length"])
    for key, title, short in (("e2e_ms", "End-to-End Latency", "E2E Latency"), ("ttft_ms", "Time to First Token",
                                                                                 "TTFT"),
                              ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl_ms", "Inter-Token Latency", "ITL")):
        lines.append(title.center(w, "-"))
        for stat in ("mean", "median", "p99"):
            row(f"{stat.capitalize() if stat != 'p99' else 'P99'} {short} (ms):", summary[key][stat])
    if summary["turns"]:
        lines.append("Per Turn".center(w, "-"))
        lines.append(f"{'turn':>4}{'ok':>6}{'prompt':>9}{'cached':>9}{'TTFT p50':>11}{'TTFT p99':>11}")
        for t in summary["turns"]:
            lines.append(f"{t['turn']:>4}{t['completed']:>6}{t['prompt_tokens_mean']:>9.0f}"
                         f"{t['cached_tokens_mean']:>9.0f}{t['ttft_ms']['median']:>11.2f}{t['ttft_ms']['p99']:>11.2f}")
        lines.append("(prompt and cached: mean tokens per request; TTFT in ms)")
    if summary["output_len_mismatches"]:
        lines.append(f"NOTE: {summary['output_len_mismatches']} requests returned a different number of tokens "
                     "than asked (is ignore_eos honoured?)")
    for err, count in summary["errors"].items():
        lines.append(f"FAILED x{count}: {err}")
    lines.append("=" * w)
    return "\n".join(lines)


# ----------------------------------------------------------------------
# command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moeserve bench serving", description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsOnceHelpFormatter)
    p.add_argument("--backend", choices=list(BACKENDS), default="moeserve",
                   help="moeserve/sglang: native /generate; openai: /v1/completions; openai-chat: "
                        "/v1/chat/completions")
    p.add_argument("--base-url", default=None, help="Server URL (overrides --host/--port), e.g. http://h:30000")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model", default=None, help="Model name for OpenAI backends (default: the server's first)")
    p.add_argument("--tokenizer", default=None,
                   help="Tokenizer directory (default: the tokenizer_path of the server's /get_model_info)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", "--dataset-name", dest="dataset", choices=DATASETS, default="random")
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON file (--dataset sharegpt)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="Lengths are uniform in [max(1, len * ratio), len]: 1.0 fixes them (SGLang's meaning)")
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="Fixed output length for ShareGPT")
    p.add_argument("--gsp-num-groups", type=int, default=64)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    p.add_argument("--gsp-question-len", type=int, default=128)
    p.add_argument("--gsp-output-len", type=int, default=256)
    p.add_argument("--multiturn-num-conversations", "--num-clients", dest="multiturn_num_conversations", type=int,
                   default=32, help="Conversations (multiturn); pick enough that their histories outgrow the "
                   "server's KV pool to measure more than the device's prefix cache")
    p.add_argument("--multiturn-turns", "--num-rounds", dest="multiturn_turns", type=int, default=4,
                   help="Turns per conversation")
    p.add_argument("--multiturn-system-prompt-len", type=int, default=256,
                   help="Tokens of the system prompt all conversations share")
    p.add_argument("--multiturn-user-len", "--request-length", dest="multiturn_user_len", type=int, default=128,
                   help="Tokens of each turn's new user message")
    p.add_argument("--multiturn-output-len", "--output-length", dest="multiturn_output_len", type=int, default=32,
                   help="Tokens of each answer")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Requests per second, Poisson arrivals; inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--disable-ignore-eos", action="store_true", help="Let requests stop at EOS")
    p.add_argument("--extra-request-body", default=None, help="JSON merged into each request's sampling options")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--ready-timeout", type=float, default=0.0,
                   help="Seconds to wait for the target to answer a one-token request before starting (0: no "
                        "wait); for servers or a router just started (sglang-router's /health answers before it "
                        "routes)")
    p.add_argument("--output-file", default=None, help="Write the summary and per-request numbers as JSON")
    p.add_argument("--plot", action="store_true",
                   help="Also write a PNG beside --output-file (its name with .png): request latency over time, "
                        "the TTFT and ITL distributions (needs matplotlib: pip install 'moeserve[plot]')")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def _get_json(url: str, api_key: str | None) -> Any:
    import urllib.request

    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def _post_json(url: str, body: dict, api_key: str | None) -> int:
    import urllib.request

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()
        return resp.status


def wait_ready(base_url: str, backend: str, timeout_s: float, model: str | None = None,
               api_key: str | None = None) -> None:
    """Block until the target answers /get_model_info and generates one token through the benchmark's endpoint.

    A router answers /health before it has checked its workers and /get_model_info before it routes, so only a
    request that comes back 200 shows that the benchmark's requests will be served. TimeoutError after
    `timeout_s` with the last failure."""
    endpoint, kind = BACKENDS[backend]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _get_json(f"{base_url}/get_model_info", api_key)
            name = model
            if name is None and kind != "native":
                name = _get_json(f"{base_url}/v1/models", api_key)["data"][0]["id"]
            body = {**_payload(kind, name, BenchRequest("Hello", 1, 1), False, {}), "stream": False}
            body.pop("stream_options", None)  # OpenAI's API takes it only with a stream
            if _post_json(base_url + endpoint, body, api_key) == 200:
                return
            last = "the probe answered without an error but not 200"
        except (OSError, ValueError, KeyError, IndexError) as e:  # HTTPError and URLError are OSErrors
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{base_url} did not serve a one-token request within {timeout_s:g} s ({last})")
        time.sleep(0.5)


def load_requests(args: argparse.Namespace, tokenizer: Any) -> list[BenchRequest] | list[Conversation]:
    if args.dataset == "random":
        return random_requests(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, args.seed)
    if args.dataset == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset sharegpt needs --dataset-path to a ShareGPT JSON file")
        return sharegpt_requests(tokenizer, args.dataset_path, args.num_prompts, args.seed, args.sharegpt_output_len)
    if args.dataset == "multiturn":
        return multiturn_conversations(tokenizer, args.multiturn_num_conversations, args.multiturn_turns,
                                       args.multiturn_system_prompt_len, args.multiturn_user_len,
                                       args.multiturn_output_len, args.seed)
    return shared_prefix_requests(tokenizer, args.gsp_num_groups, args.gsp_prompts_per_group,
                                  args.gsp_system_prompt_len, args.gsp_question_len, args.gsp_output_len, args.seed)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    if args.max_concurrency is not None and args.max_concurrency < 1:
        print("--max-concurrency must be >= 1", file=sys.stderr)
        return 2
    if args.plot and not args.output_file:
        print("--plot writes its PNG beside the JSON result: give --output-file too", file=sys.stderr)
        return 2
    if args.plot and not have_matplotlib():
        print(f"--plot: {MISSING}", file=sys.stderr)
        return 2
    extra = json.loads(args.extra_request_body) if args.extra_request_body else {}

    tokenizer_path = args.tokenizer
    model = args.model
    try:
        if args.ready_timeout > 0:
            wait_ready(base_url, args.backend, args.ready_timeout, model, args.api_key)
        if tokenizer_path is None:
            tokenizer_path = _get_json(f"{base_url}/get_model_info", args.api_key).get("tokenizer_path")
            if not tokenizer_path:
                print("the server has no tokenizer; pass --tokenizer", file=sys.stderr)
                return 2
        if model is None and args.backend in ("openai", "openai-chat"):
            model = _get_json(f"{base_url}/v1/models", args.api_key)["data"][0]["id"]
    except TimeoutError as e:
        print(str(e), file=sys.stderr)
        return 1
    except OSError as e:
        print(f"cannot reach {base_url}: {e} (is the server up? else pass --tokenizer and --model)", file=sys.stderr)
        return 1

    from moeserve.text.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(tokenizer_path)
        # Counted as the server will (BOS, or the chat template), so that this header and the table agree.
        chat = BACKENDS[args.backend][1] == "chat"
        reqs = load_requests(args, tokenizer)
        if args.dataset != "multiturn":  # a conversation's prompts grow with its answers: counted as sent
            reqs = [replace(r, prompt_len=served_prompt_len(tokenizer, r.prompt, chat)) for r in reqs]
    except (ValueError, OSError) as e:
        print(f"dataset: {e}", file=sys.stderr)
        return 2
    if args.dataset == "multiturn":
        turns, system = args.multiturn_turns, args.multiturn_system_prompt_len
        per_conv = system + turns * (args.multiturn_user_len + args.multiturn_output_len)
        print(f"{len(reqs)} conversations of {turns} turns, system prompt {system} tokens shared: a working set "
              f"of about {system + len(reqs) * (per_conv - system)} tokens, {per_conv} per conversation "
              f"-> {base_url}{BACKENDS[args.backend][0]}")
    else:
        print(f"{len(reqs)} requests ({args.dataset}), {sum(r.prompt_len for r in reqs)} prompt tokens "
              f"({'chat template' if chat else 'BOS'} included, as the server counts them), "
              f"{sum(r.output_len for r in reqs)} output tokens -> {base_url}{BACKENDS[args.backend][0]}")

    results, duration = asyncio.run(run_benchmark(
        base_url, args.backend, model, reqs, args.request_rate, args.max_concurrency, args.seed,
        not args.disable_ignore_eos, extra, args.api_key, args.warmup_requests, not args.disable_tqdm, tokenizer))
    summary = summarize(results, duration)
    print(format_report(summary, args.backend, args.request_rate, args.max_concurrency))
    if args.output_file:
        config = {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()}
        record = {"config": {**config, "base_url": base_url, "model": model, "tokenizer": tokenizer_path},
                  "summary": summary,
                  "requests": [{k: v for k, v in asdict(r).items() if k != "output_text"} for r in results]}
        with open(args.output_file, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {args.output_file}")
    if args.plot:
        from moeserve.bench.serving_plot import plot_run

        png = Path(args.output_file).with_suffix(".png")
        plot_run(results, png, f"bench serving: {args.backend}, {len(reqs)} requests ({args.dataset}), "
                               f"concurrency {args.max_concurrency or 'unbounded'}")
        print(f"wrote {png}")
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
