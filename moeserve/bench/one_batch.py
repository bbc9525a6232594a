"""`moeserve bench one-batch`: prefill and decode throughput of one static batch, optionally beside transformers.

The batch runs through the real scheduler and model runner in this process (no HTTP, no ZeroMQ): one prefill of
`batch_size` prompts of `input_len` random tokens, then decode steps until each has `output_len` tokens.
With --compare-transformers the same shapes run through transformers' `generate` on the same checkpoint
(or, with --load-format dummy, on a model built from the same config.json with its own random weights) in the
same run, and the ratio is printed.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from moeserve.args import ServerArgs
from moeserve.bench.results import append_results
from moeserve.models.default_model import resolve_model_path


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_round(rounds: list[dict], batch_size: int, input_len: int, output_len: int) -> dict:
    """The rounds' median prefill and decode times (each on its own), with the tokens/s they give."""
    import statistics

    r = {"prefill_s": statistics.median(x["prefill_s"] for x in rounds),
         "decode_s": statistics.median(x["decode_s"] for x in rounds), "rounds": len(rounds)}
    r["prefill_tok_s"] = batch_size * input_len / r["prefill_s"]
    r["decode_tok_s"] = batch_size * (output_len - 1) / max(r["decode_s"], 1e-9)
    if len(rounds) > 1:
        r["decode_tok_s_all"] = [batch_size * (output_len - 1) / max(x["decode_s"], 1e-9) for x in rounds]
    return r


def run_moeserve(args: ServerArgs, batch_size: int, input_len: int, output_len: int, seed: int,
                 warmup: bool = True, repeat: int = 1, profile_dir: str | None = None, runner=None) -> dict:
    """runner: a ModelRunner to reuse (one load and one set of CUDA-graph captures for several batch sizes)."""
    from moeserve.rank.io_struct import GenerateReq
    from moeserve.rank.model_runner import ModelRunner
    from moeserve.rank.sampling_params import SamplingParams
    from moeserve.rank.scheduler import Scheduler
    from moeserve.rank.worker import run_step

    runner = runner or ModelRunner(args)
    gen = torch.Generator().manual_seed(seed)

    def one_round(tag: str) -> dict:
        sched = Scheduler(args, runner.num_pages, runner.context_length, [], dp_rank=0)
        for i in range(batch_size):
            ids = torch.randint(0, runner.vocab_size, (input_len,), generator=gen).tolist()
            params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
            sched.add_request(GenerateReq(f"{tag}{i}", ids, params))
        _sync(runner.device)
        t0 = time.perf_counter()
        prefill_steps = 0
        while sched.waiting or sched.chunked:
            run_step(sched, runner)
            prefill_steps += 1
        _sync(runner.device)
        t1 = time.perf_counter()
        decode_steps = 0
        while sched.has_work():
            run_step(sched, runner)
            decode_steps += 1
        _sync(runner.device)
        t2 = time.perf_counter()
        return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "prefill_steps": prefill_steps,
                "decode_steps": decode_steps}

    if warmup:
        one_round("warmup")
    r = _median_round([one_round(f"run{i}-") for i in range(repeat)], batch_size, input_len, output_len)
    if profile_dir is not None:
        r["profile"] = _profile_round(args, runner, batch_size, input_len, gen, profile_dir)
    r["device"] = str(runner.device)
    r["dtype"] = str(runner.dtype)
    return r


def _profile_round(args: ServerArgs, runner, batch_size: int, input_len: int, gen: torch.Generator,
                   profile_dir: str) -> dict:
    """One more batch of distinct random prompts: its prefill profiled, 4 decode steps to settle, then 5 profiled
    decode steps."""
    from moeserve.bench.step_profile import format_table, profile_steps
    from moeserve.rank.io_struct import GenerateReq
    from moeserve.rank.sampling_params import SamplingParams
    from moeserve.rank.scheduler import Scheduler
    from moeserve.rank.worker import run_step

    sched = Scheduler(args, runner.num_pages, runner.context_length, [], dp_rank=0)
    for i in range(batch_size):
        ids = torch.randint(0, runner.vocab_size, (input_len,), generator=gen).tolist()
        sched.add_request(GenerateReq(f"profile{i}", ids, SamplingParams(max_new_tokens=64, temperature=0.0,
                                                                         ignore_eos=True)))

    def prefill() -> None:
        while sched.waiting or sched.chunked:
            run_step(sched, runner)

    prefill_trace = os.path.join(profile_dir, f"one_batch_prefill_bs{batch_size}.json.gz")
    prefill_result = profile_steps(prefill, 1, prefill_trace)
    print(format_table(f"prefill of {batch_size} x {input_len} tokens", prefill_result), flush=True)
    for _ in range(4):
        run_step(sched, runner)
    trace = os.path.join(profile_dir, f"one_batch_bs{batch_size}.json.gz")
    result = profile_steps(lambda: run_step(sched, runner), 5, trace)
    print(format_table(f"decode step at batch {batch_size}", result), flush=True)
    print(f"traces: {prefill_trace} {trace}", flush=True)
    return {"decode": result, "prefill": prefill_result}


def run_transformers(args: ServerArgs, batch_size: int, input_len: int, output_len: int, seed: int,
                     repeat: int = 1) -> dict:
    """transformers' generate with the same shapes (greedy, no EOS stop)."""
    import transformers

    from moeserve.rank.model_runner import resolve_device

    device = resolve_device(args.device)
    dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[args.dtype]
    if args.load_format == "dummy":
        config = transformers.AutoConfig.from_pretrained(args.model_path)
        torch.manual_seed(seed)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype or "auto").to(device)
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch_size, input_len), generator=gen).to(device)
    mask = torch.ones_like(ids)
    kw = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:, :8], attention_mask=mask[:, :8], **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
        rounds = []
        for _ in range(repeat):
            _sync(device)
            t0 = time.perf_counter()
            model(ids, attention_mask=mask, logits_to_keep=1)
            _sync(device)
            t1 = time.perf_counter()
            model.generate(ids, attention_mask=mask, **kw)
            _sync(device)
            t2 = time.perf_counter()
            # generate's time minus one prefill: its decode steps
            rounds.append({"prefill_s": t1 - t0, "decode_s": max((t2 - t1) - (t1 - t0), 1e-9)})
    return _median_round(rounds, batch_size, input_len, output_len)


def _free_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moeserve bench one-batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(p)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 16])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--repeat", type=int, default=1,
                   help="Measured rounds per system (after one warm-up round); the median time is reported.")
    p.add_argument("--compare-transformers", action="store_true")
    p.add_argument("--result-file", default=None, help="Append one JSON line per batch size.")
    p.add_argument("--profile", action="store_true",
                   help="After the measured rounds, profile 5 decode steps of a fresh batch (distinct random "
                        "prompts): a torch-profiler trace per batch size and the per-part table (CUDA only).")
    p.add_argument("--profile-dir", default="profiles", help="Where --profile writes its traces.")
    ns = p.parse_args(argv)
    args = ServerArgs.from_cli_args(ns)  # takes the ServerArgs fields, leaves the benchmark's own flags
    if ns.profile:
        from moeserve.rank.model_runner import resolve_device

        if resolve_device(args.device).type != "cuda":
            raise SystemExit("--profile needs a CUDA device (the table is made of device kernels)")
    resolve_model_path(args)
    rows = []
    shared_runner = None
    if not ns.compare_transformers:  # one model for every batch size (transformers' needs the memory back)
        from moeserve.rank.model_runner import ModelRunner

        shared_runner = ModelRunner(args)
    for bs in ns.batch_size:
        r = {"batch_size": bs, "input_len": ns.input_len, "output_len": ns.output_len,
             "moeserve": run_moeserve(args, bs, ns.input_len, ns.output_len, ns.seed, repeat=ns.repeat,
                                      profile_dir=ns.profile_dir if ns.profile else None, runner=shared_runner)}
        _free_memory()
        if ns.compare_transformers:
            r["transformers"] = run_transformers(args, bs, ns.input_len, ns.output_len, ns.seed, ns.repeat)
            _free_memory()
            r["decode_speedup"] = r["moeserve"]["decode_tok_s"] / r["transformers"]["decode_tok_s"]
            r["prefill_speedup"] = r["moeserve"]["prefill_tok_s"] / r["transformers"]["prefill_tok_s"]
        rows.append(r)
        m = r["moeserve"]
        line = (f"batch {bs:4d}  in {ns.input_len}  out {ns.output_len}  moeserve: prefill {m['prefill_tok_s']:9.1f} "
                f"tok/s  decode {m['decode_tok_s']:9.1f} tok/s")
        if ns.compare_transformers:
            t = r["transformers"]
            line += (f" | transformers: prefill {t['prefill_tok_s']:9.1f}  decode {t['decode_tok_s']:9.1f}"
                     f" | speedup prefill {r['prefill_speedup']:.2f}x decode {r['decode_speedup']:.2f}x")
        print(line, flush=True)
        append_results(ns.result_file, [r])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
