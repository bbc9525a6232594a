"""`moeserve bench one-batch`: prefill and decode throughput of one static batch, optionally beside transformers.

The batch runs through the real scheduler and model runner in this process (no HTTP, no ZeroMQ): one prefill of
`batch_size` prompts of `input_len` random tokens, then decode steps until each has `output_len` tokens.
With --compare-transformers the same shapes run through transformers' `generate` on the same checkpoint
(or, with --load-format dummy, on a model built from the same config.json with its own random weights) in the
same run, and the ratio is printed. With --load-format dummy, transformers loads moeserve's dummy weights
(written to a temporary checkpoint), so the two run the same model.

The greedy tokens of moeserve's first measured round are compared with transformers' on the same prompts: the
report says how many requests' tokens are equal, and for any other where they first differ and transformers' gap
between its two best logits there (a near tie, under 1e-4, is a rounding difference, not an error).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist

from moeserve.args import ServerArgs
from moeserve.bench.results import append_results
from moeserve.models.default_model import resolve_model_path
from moeserve.models.loader import dummy_tensor


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
    if rounds[0].get("accept_length") is not None:  # speculative decoding: tokens per verify round
        r["accept_length"] = statistics.median(x["accept_length"] for x in rounds)
    if len(rounds) > 1:
        r["decode_tok_s_all"] = [batch_size * (output_len - 1) / max(x["decode_s"], 1e-9) for x in rounds]
    return r


def run_moeserve(args: ServerArgs, batch_size: int, input_len: int, output_len: int, seed: int,
                 warmup: bool = True, repeat: int = 1, profile_dir: str | None = None, runner=None,
                 dummy_weights: bool = False) -> dict:
    """The timed rounds; the first's prompts and tokens under "prompts" and "tokens", and with dummy_weights
    (and --load-format dummy) every checkpoint tensor under "checkpoint", for the comparison with transformers.
    runner: a ModelRunner to reuse (one load and one set of CUDA-graph captures for several batch sizes)."""
    from moeserve.rank.io_struct import GenerateReq
    from moeserve.rank.model_runner import ModelRunner
    from moeserve.rank.sampling_params import SamplingParams
    from moeserve.rank.scheduler import Scheduler
    from moeserve.rank.steps import StepPipeline

    runner = runner or ModelRunner(args)
    gen = torch.Generator().manual_seed(seed)

    def one_round(tag: str) -> dict:
        sched = Scheduler.for_runner(args, runner, eos_token_ids=[])
        prompts = [torch.randint(0, runner.vocab_size, (input_len,), generator=gen).tolist()
                   for _ in range(batch_size)]
        tokens: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(batch_size)}
        for i, ids in enumerate(prompts):
            params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
            sched.add_request(GenerateReq(f"{tag}{i}", ids, params))
        steps = StepPipeline(sched, runner, overlap=not args.disable_overlap_schedule)
        _sync(runner.device)
        t0 = time.perf_counter()
        prefill_steps = 0
        while sched.waiting or sched.chunked:  # (prefill steps are resolved before they return)
            _collect(tokens, steps.step())
            prefill_steps += 1
        _sync(runner.device)
        t1 = time.perf_counter()
        decode_steps = 0
        while sched.has_work() or steps.busy:
            _collect(tokens, steps.step())
            decode_steps += 1
        _sync(runner.device)
        t2 = time.perf_counter()
        st = sched.stats
        return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "prefill_steps": prefill_steps,
                "decode_steps": decode_steps, "prompts": prompts, "tokens": list(tokens.values()),
                "accept_length": (st.spec_accepted + st.spec_rounds) / st.spec_rounds if st.spec_rounds else None}

    if warmup:
        one_round("warmup")
    rounds = [one_round(f"run{i}-") for i in range(repeat)]
    r = _median_round(rounds, batch_size, input_len, output_len)
    if profile_dir is not None:
        r["profile"] = _profile_round(args, runner, batch_size, input_len, gen, profile_dir)
    r["device"] = str(runner.device)
    r["dtype"] = str(runner.dtype)
    r["prompts"], r["tokens"] = rounds[0]["prompts"], rounds[0]["tokens"]  # for the token check, not the report
    if dummy_weights and args.load_format == "dummy":
        # drawn on the runner's device, as fill_dummy drew them (a CUDA generator's numbers are not a CPU one's)
        # (every tensor the loader drew: the fused shared experts' too, which the loaded model no longer names)
        r["checkpoint"] = {key: dummy_tensor(key, shape, runner.dtype, runner.device, args.random_seed).cpu()
                           for key, shape in runner.model.checkpoint_shapes.items()}
    return r


def _collect(tokens: dict[str, list[int]], outs) -> None:
    for o in outs or []:
        tokens[o.rid].extend(o.new_token_ids)


def _profile_round(args: ServerArgs, runner, batch_size: int, input_len: int, gen: torch.Generator,
                   profile_dir: str) -> dict:
    """One more batch of distinct random prompts: its prefill profiled, 4 decode steps to settle, then 5 profiled
    decode steps."""
    from moeserve.bench.step_profile import format_table, profile_steps
    from moeserve.rank.io_struct import GenerateReq
    from moeserve.rank.sampling_params import SamplingParams
    from moeserve.rank.scheduler import Scheduler
    from moeserve.rank.steps import StepPipeline

    sched = Scheduler.for_runner(args, runner, eos_token_ids=[])
    steps = StepPipeline(sched, runner, overlap=not args.disable_overlap_schedule)
    for i in range(batch_size):
        ids = torch.randint(0, runner.vocab_size, (input_len,), generator=gen).tolist()
        sched.add_request(GenerateReq(f"profile{i}", ids, SamplingParams(max_new_tokens=64, temperature=0.0,
                                                                         ignore_eos=True)))

    def prefill() -> None:
        while sched.waiting or sched.chunked:
            steps.step()

    prefill_trace = os.path.join(profile_dir, f"one_batch_prefill_bs{batch_size}.json.gz")
    prefill_result = profile_steps(prefill, 1, prefill_trace)
    print(format_table(f"prefill of {batch_size} x {input_len} tokens", prefill_result), flush=True)
    for _ in range(4):
        steps.step()
    trace = os.path.join(profile_dir, f"one_batch_bs{batch_size}.json.gz")
    result = profile_steps(steps.step, 5, trace)
    print(format_table(f"decode step at batch {batch_size}", result), flush=True)
    print(f"traces: {prefill_trace} {trace}", flush=True)
    return {"decode": result, "prefill": prefill_result}


def run_transformers(args: ServerArgs, batch_size: int, input_len: int, output_len: int, seed: int,
                     repeat: int = 1, check: dict | None = None) -> dict:
    """transformers' generate with the same shapes (greedy, no EOS stop). `check`: moeserve's result (its dummy
    weights under "checkpoint", its prompts and tokens): the same weights are loaded and the tokens compared."""
    import transformers

    from moeserve.rank.model_runner import resolve_device

    device = resolve_device(args.device)
    dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[args.dtype]
    if args.load_format == "dummy" and check is not None and "checkpoint" in check:
        model = _load_dummy_checkpoint(args.model_path, check.pop("checkpoint"), dtype).to(device)
    elif args.load_format == "dummy":
        config = transformers.AutoConfig.from_pretrained(args.model_path)
        torch.manual_seed(seed)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype or "auto").to(device)
    model.eval()
    tokens = _compare_tokens(model, check, output_len, device) if check is not None else None
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
    r = _median_round(rounds, batch_size, input_len, output_len)
    if tokens is not None:
        r["tokens"] = tokens
    return r


def _load_dummy_checkpoint(config_dir: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None):
    """transformers' model of config_dir with moeserve's dummy weights (saved to a temporary checkpoint, which
    transformers reads with its own key conversions)."""
    import shutil
    from pathlib import Path

    import transformers
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="moeserve-bench-") as tmp:
        shutil.copy(Path(config_dir) / "config.json", tmp)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(Path(tmp) / "model.safetensors"),
                  metadata={"format": "pt"})
        return transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype or "auto")


NEAR_TIE = 1e-4  # transformers' top-2 logit gap under which a different greedy token is a rounding difference


def _compare_tokens(model, check: dict, output_len: int, device: torch.device) -> dict:
    """transformers' greedy tokens on moeserve's prompts against moeserve's: requests equal, and for the others
    the first differing position and transformers' top-2 logit gap there."""
    import copy

    prompts = torch.tensor(check["prompts"], device=device)
    # moeserve's ignore_eos may choose the EOS token and go on, where min_new_tokens would forbid it and an EOS
    # would end (pad) the sequence: transformers is told of no EOS token for this call.
    saved = copy.deepcopy(model.generation_config), model.config.eos_token_id
    model.generation_config.eos_token_id = model.config.eos_token_id = None
    try:
        with torch.inference_mode():
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=output_len,
                                 do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    finally:
        model.generation_config, model.config.eos_token_id = saved
    theirs = out.sequences[:, prompts.shape[1]:].tolist()
    differ = []
    for b, (ours, ref) in enumerate(zip(check["tokens"], theirs, strict=True)):
        if ours != ref:
            j = next((i for i, (a, c) in enumerate(zip(ours, ref, strict=False)) if a != c), min(len(ours), len(ref)))
            top2 = out.logits[j][b].float().topk(2).values if j < len(out.logits) else None
            gap = float(top2[0] - top2[1]) if top2 is not None else float("nan")
            differ.append({"request": b, "position": j, "top2_gap": gap})
    return {"requests": len(theirs), "equal": len(theirs) - len(differ), "differ": differ,
            "near_ties_only": all(d["top2_gap"] < NEAR_TIE for d in differ)}


def _tokens_line(t: dict) -> str:
    line = f"  greedy tokens: {t['equal']}/{t['requests']} requests equal to transformers'"
    if t["differ"]:
        first = ", ".join(f"request {d['request']} from token {d['position']} (top-2 gap {d['top2_gap']:.1e})"
                          for d in t["differ"][:4])
        line += f"; differ: {first}" + (" - near ties only" if t["near_ties_only"] else " - NOT near ties")
    return line


def _free_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _init_one_rank_group(args: ServerArgs) -> None:
    """The EP dispatchers talk through torch.distributed even on one rank, as the server's worker sets up."""
    from moeserve.models.options import dispatch_options
    from moeserve.rank.model_runner import resolve_device

    if args.tp_size > 1:
        raise SystemExit("bench one-batch runs one rank; for several ranks use `moeserve bench serving`")
    if not dispatch_options(args).needs_process_group or dist.is_initialized():
        return
    backend = "nccl" if resolve_device(args.device).type == "cuda" else "gloo"
    store = os.path.join(tempfile.mkdtemp(prefix="moeserve-one-batch-"), "rendezvous")
    dist.init_process_group(backend, init_method=f"file://{store}", world_size=1, rank=0)


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
    _init_one_rank_group(args)
    rows = []
    shared_runner = None
    if not ns.compare_transformers:  # one model for every batch size (transformers' needs the memory back)
        from moeserve.rank.model_runner import ModelRunner

        shared_runner = ModelRunner(args)
    for bs in ns.batch_size:
        r = {"batch_size": bs, "input_len": ns.input_len, "output_len": ns.output_len,
             "moeserve": run_moeserve(args, bs, ns.input_len, ns.output_len, ns.seed, repeat=ns.repeat,
                                      profile_dir=ns.profile_dir if ns.profile else None, runner=shared_runner,
                                      dummy_weights=ns.compare_transformers)}
        _free_memory()
        if ns.compare_transformers:
            r["transformers"] = run_transformers(args, bs, ns.input_len, ns.output_len, ns.seed, ns.repeat,
                                                 check=r["moeserve"])
            _free_memory()
            r["decode_speedup"] = r["moeserve"]["decode_tok_s"] / r["transformers"]["decode_tok_s"]
            r["prefill_speedup"] = r["moeserve"]["prefill_tok_s"] / r["transformers"]["prefill_tok_s"]
        m = r["moeserve"]
        for key in ("prompts", "tokens", "checkpoint"):
            m.pop(key, None)
        rows.append(r)
        line = (f"batch {bs:4d}  in {ns.input_len}  out {ns.output_len}  moeserve: prefill {m['prefill_tok_s']:9.1f} "
                f"tok/s  decode {m['decode_tok_s']:9.1f} tok/s")
        if m.get("accept_length") is not None:
            line += f"  accept length {m['accept_length']:.2f}"
        if ns.compare_transformers:
            t = r["transformers"]
            line += (f" | transformers: prefill {t['prefill_tok_s']:9.1f}  decode {t['decode_tok_s']:9.1f}"
                     f" | speedup prefill {r['prefill_speedup']:.2f}x decode {r['decode_speedup']:.2f}x")
        print(line, flush=True)
        if ns.compare_transformers:
            low = "" if m["dtype"] == "torch.float32" else f" ({m['dtype']}: roundings differ, tokens may too)"
            print(_tokens_line(r["transformers"]["tokens"]) + low, flush=True)
        append_results(ns.result_file, [r])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
