"""`moeserve bench pd`: PD disaggregation (prefill server + decode server behind sglang-router) beside one
colocated server, on the same prompts, in one run.

    moeserve bench pd --num-prompts 64 --random-input-len 256 --random-output-len 32 --max-concurrency 16 \\
        -- --model-path benchmarks/configs/deepseek-v3-tiny-kv512 --load-format dummy

For each of --runs, in order, it starts fresh servers (so no run sees another's prefix cache), waits until they
serve, sends the warm-up requests (--warmup-requests prompts of the same shape drawn with another seed, at the
same concurrency), then the measured ones (`moeserve bench serving`'s load generator: the same distinct random
prompts for every run), reads the KV transfer counters of both PD servers (/get_server_info) before and after,
and stops everything it started. It prints one table, one column per run: TTFT and ITL p50/p99, output tok/s,
requests/s, and for PD the KV bytes moved, the mean transfer latency (from decode's destination to prefill's last
write, prefill's own count: it includes the prompt's queueing and compute) and the bytes over that time.

Flags before `--` are this command's and `moeserve bench serving`'s (dataset, lengths, concurrency, rate, seed,
warm-up); flags after `--` go to every `moeserve serve` (model, dtype, ...). --prefill-flags, --decode-flags and
--colocated-flags add flags for one role, --router-flags flags for sglang-router.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import shlex
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moeserve.bench import serving
from moeserve.bench.datasets import BenchRequest
from moeserve.bench.pd_procs import Launcher, get_json, transfer_counters
from moeserve.bench.pd_report import side_by_side, transfer_summary
from moeserve.help_text import DefaultsOnceHelpFormatter
from moeserve.server.launch import free_port

RUNS = ("colocated", "zmq", "mooncake")  # colocated, or PD with that transfer backend
OWN_SERVE_FLAGS = ("--host", "--port", "--disaggregation-mode", "--disaggregation-transfer-backend",
                   "--disaggregation-bootstrap-port")  # set here, per role and run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moeserve bench pd", description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsOnceHelpFormatter,
                                epilog="Any other flag before `--` is `moeserve bench serving`'s.")
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS),
                   help="What to run, in order: one colocated server, and PD with each transfer backend")
    p.add_argument("--prefill-flags", default="",
                   help="More `moeserve serve` flags for the prefill server, one string: --prefill-flags='--a 1'")
    p.add_argument("--decode-flags", default="", help="More `moeserve serve` flags for the decode server")
    p.add_argument("--colocated-flags", default="", help="More `moeserve serve` flags for the colocated server")
    p.add_argument("--router-flags", default="",
                   help="More sglang-router flags, one string: --router-flags='--disable-circuit-breaker'")
    p.add_argument("--server-timeout", type=float, default=600.0,
                   help="Seconds for the servers to start, and for the router to serve")
    p.add_argument("--log-dir", default=None, help="Server and router logs (default: a new temporary directory)")
    p.add_argument("--output-file", default=None, help="Write the configuration and every run's summary as JSON")
    return p


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace, list[str]]:
    """(this command's options, bench serving's options, the servers' flags); SystemExit(2) on bad flags."""
    ours, serve_flags = _split(argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(ours)
    bench_parser = serving.build_parser()
    bench_parser.prog = "moeserve bench pd"
    bench_parser.set_defaults(host=None, port=None)
    bench = bench_parser.parse_args(rest)
    if bench.base_url is not None or bench.host is not None or bench.port is not None:
        parser.error("--host/--port/--base-url name the target, which this command starts itself")
    if bench.ready_timeout:
        parser.error("--ready-timeout: this command waits for its targets itself (--server-timeout)")
    if bench.api_key is not None:
        parser.error("--api-key: bench pd reads the servers' counters without a key; run it without one")
    all_flags = serve_flags + [f for role in (args.prefill_flags, args.decode_flags, args.colocated_flags)
                               for f in shlex.split(role)]
    for flag in all_flags:
        name = flag.split("=", 1)[0]
        if name == "--api-key":
            parser.error("server flag --api-key: bench pd reads the servers' counters without a key")
        if name in OWN_SERVE_FLAGS:
            parser.error(f"server flag {name}: this command sets the servers' addresses, PD roles and transfer "
                         "backends itself (--runs picks the backends)")
    if bench.max_concurrency is not None and bench.max_concurrency < 1:
        parser.error("--max-concurrency must be >= 1")
    if len(set(args.runs)) != len(args.runs):
        parser.error("--runs names a run twice")
    return args, bench, serve_flags


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def check_runs(runs: list[str]) -> None:
    """ValueError saying what is missing for a PD run, before any server starts."""
    if any(r != "colocated" for r in runs):
        try:
            import sglang_router  # noqa: F401 - only that it is there
        except ImportError:
            raise ValueError("the PD runs need sglang-router (`pip install sglang-router`, in the pd extra); "
                             "or pass --runs colocated") from None
    if "mooncake" in runs:
        from moeserve.disagg.transfer.registry import backend_class

        try:
            backend_class("mooncake")
        except ValueError as e:
            raise ValueError(f"{e}; or leave mooncake out of --runs (e.g. --runs colocated zmq)") from None


# ----------------------------------------------------------------------
# one run
def start_targets(launcher: Launcher, run: str, args: argparse.Namespace,
                  serve_flags: list[str]) -> tuple[str, list[str]]:
    """Start the servers of one run: (the URL the benchmark targets, the PD servers' URLs, prefill first)."""
    if run == "colocated":
        server = launcher.serve("colocated", serve_flags + shlex.split(args.colocated_flags))
        launcher.wait_healthy([server], args.server_timeout)
        return server.url, []
    bootstrap_port = free_port()
    backend = ["--disaggregation-transfer-backend", run]
    prefill = launcher.serve(f"prefill-{run}", [*serve_flags, *shlex.split(args.prefill_flags), *backend,
                                                "--disaggregation-mode", "prefill",
                                                "--disaggregation-bootstrap-port", str(bootstrap_port)])
    decode = launcher.serve(f"decode-{run}", [*serve_flags, *shlex.split(args.decode_flags), *backend,
                                              "--disaggregation-mode", "decode"])
    launcher.wait_healthy([prefill, decode], args.server_timeout)
    router = launcher.router(f"router-{run}", prefill, bootstrap_port, decode, args.server_timeout,
                             shlex.split(args.router_flags))
    return router.url, [prefill.url, decode.url]


def make_requests(url: str, bench: argparse.Namespace) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """(measured, warm-up) requests; the warm-up prompts are drawn with another seed so that none is a prefix
    of a measured one (the prefix cache would make the measured run look faster)."""
    from moeserve.text.tokenizer import load_tokenizer

    path = bench.tokenizer or get_json(url + "/get_model_info").get("tokenizer_path")
    if not path:
        raise ValueError("the server has no tokenizer; pass --tokenizer (or --tokenizer-path after `--`)")
    tokenizer = load_tokenizer(path)
    measured = serving.load_requests(bench, tokenizer)
    warm: list[BenchRequest] = []
    if bench.warmup_requests > 0:
        warm_args = argparse.Namespace(**{**vars(bench), "num_prompts": bench.warmup_requests,
                                          "seed": bench.seed + 1_000_003})
        warm = serving.load_requests(warm_args, tokenizer)[:bench.warmup_requests]
    return measured, warm


def measure(url: str, pd_urls: list[str], bench: argparse.Namespace, measured: list[BenchRequest],
            warm: list[BenchRequest], launcher: Launcher) -> dict[str, Any]:
    """Warm up, then run the measured requests; the bench summary, the PD transfer counters' growth, the load."""
    extra = json.loads(bench.extra_request_body) if bench.extra_request_body else {}
    model = bench.model
    if model is None and bench.backend in ("openai", "openai-chat"):
        model = get_json(url + "/v1/models")["data"][0]["id"]

    def go(reqs: list[BenchRequest], progress: bool) -> tuple[list[serving.RequestResult], float]:
        return asyncio.run(serving.run_benchmark(
            url, bench.backend, model, reqs, bench.request_rate, bench.max_concurrency, bench.seed,
            not bench.disable_ignore_eos, extra, bench.api_key, warmup_requests=0, show_progress=progress))

    if warm:
        results, _ = go(warm, False)
        bad = [r.error for r in results if not r.success]
        if bad:
            launcher.check_alive()
            raise RuntimeError(f"{len(bad)} of {len(warm)} warm-up requests failed, e.g. {bad[0]}")
    before = [transfer_counters(u) for u in pd_urls]
    load_before = os.getloadavg()[0]
    results, duration = go(measured, not bench.disable_tqdm)
    load_after = os.getloadavg()[0]
    after = [transfer_counters(u) for u in pd_urls]
    summary = serving.summarize(results, duration)
    if summary["failed"]:
        launcher.check_alive()
    out: dict[str, Any] = {"summary": summary, "loadavg_1m": [round(load_before, 2), round(load_after, 2)]}
    if pd_urls:
        out["transfer"] = {side: {k: a[k] - b[k] for k in a} for side, b, a in zip(("prefill", "decode"), before,
                                                                                      after, strict=True)}
        out["transfer"]["summary"] = transfer_summary(out["transfer"]["prefill"], duration)
    return out


def run_all(args: argparse.Namespace, bench: argparse.Namespace, serve_flags: list[str], log_dir: Path,
            on_run: Callable[[dict[str, dict[str, Any]]], None] | None = None) -> dict[str, dict[str, Any]]:
    """Every run of --runs, in order, each on fresh servers; on_run(results so far) after each; every process is
    stopped before this returns."""
    launcher = Launcher(log_dir)
    results: dict[str, dict[str, Any]] = {}
    measured: list[BenchRequest] | None = None
    warm: list[BenchRequest] = []
    try:
        for run in args.runs:
            url, pd_urls = start_targets(launcher, run, args, serve_flags)
            serving.wait_ready(url, bench.backend, args.server_timeout, bench.model, bench.api_key)
            if measured is None:
                measured, warm = make_requests(url, bench)
                print(f"{len(measured)} requests ({bench.dataset}), {sum(r.prompt_len for r in measured)} prompt "
                      f"tokens, {sum(r.output_len for r in measured)} output tokens; {len(warm)} warm-up requests",
                      flush=True)
            print(f"--- {run}: serving at {url}", flush=True)
            results[run] = measure(url, pd_urls, bench, measured, warm, launcher)
            print(serving.format_report(results[run]["summary"], f"{bench.backend} ({run})", bench.request_rate,
                                        bench.max_concurrency), flush=True)
            launcher.stop_all()
            if on_run is not None:
                on_run(results)
    finally:
        launcher.stop_all()
    return results


def _write_record(args: argparse.Namespace, bench: argparse.Namespace, serve_flags: list[str],
                  results: dict[str, dict[str, Any]]) -> None:
    config = {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(bench).items()}
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": platform.node(), "cpus": os.cpu_count(), "runs": args.runs, "serve_flags": serve_flags,
              "prefill_flags": args.prefill_flags, "decode_flags": args.decode_flags,
              "colocated_flags": args.colocated_flags, "router_flags": args.router_flags, "bench": config,
              "results": results}
    with open(args.output_file, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)


def _raise_on_signal(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # so that run_all's `finally` stops the servers


def main(argv: list[str] | None = None) -> int:
    args, bench, serve_flags = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        check_runs(args.runs)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="moeserve-bench-pd-"))
    print(f"logs in {log_dir}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"{os.cpu_count()} CPUs", flush=True)
    def write(results: dict[str, dict[str, Any]]) -> None:  # after every run: a later failure keeps the earlier
        if args.output_file:
            _write_record(args, bench, serve_flags, results)

    old = signal.signal(signal.SIGTERM, _raise_on_signal)
    try:
        results = run_all(args, bench, serve_flags, log_dir, write)
    except (RuntimeError, ValueError, TimeoutError, OSError) as e:
        print(f"moeserve bench pd: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("moeserve bench pd: interrupted; every server it started is stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)
    print(side_by_side(results, bench))
    if args.output_file:
        print(f"wrote {args.output_file}")
    return 0 if all(r["summary"]["failed"] == 0 for r in results.values()) else 1
