"""Online EPLB on one GPU: decode throughput while the prepare phase uploads experts, and the execute stall per
chunk of MoE layers.

    python3 benchmark/experiments/eplb_bench.py [--batch 64] [--redundant 16] [--layers-per-chunk 1] [--weights memory]

V2-Lite-shaped dummy model in bf16 with redundant expert slots, one rank (EP 1), decode steps of `batch` requests
(distinct random prompts) through the scheduler and model runner with CUDA graphs. A rebalance is started to a
placement that gives every redundant slot another expert (`Rebalancer.rebalance_to(..., from_host=True)`: every incoming
expert comes from the host weight source, as on a rank of a multi-GPU server that did not hold it). Measured:
the decode steps before it (baseline), the steps while the prepare thread uploads (throughput relative to the
baseline), each execute chunk's stall, and the steps after it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from moeserve.args import ServerArgs
from moeserve.eplb.location import ExpertLocation
from moeserve.eplb.rebalancer import WORKING
from moeserve.rank.io_struct import GenerateReq
from moeserve.rank.model_runner import ModelRunner
from moeserve.rank.sampling_params import SamplingParams
from moeserve.rank.scheduler import Scheduler
from moeserve.rank.steps import run_step


def _step(sched: Scheduler, runner: ModelRunner) -> float:
    # the serving stream only (as the worker waits for its tokens): a device-wide sync would wait for the
    # prepare phase's uploads on their side stream too
    sync = torch.cuda.current_stream().synchronize if runner.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    run_step(sched, runner)
    sync()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--redundant", type=int, default=16)
    p.add_argument("--layers-per-chunk", type=int, default=1)
    p.add_argument("--weights", default="memory", choices=("memory", "mmap"))
    p.add_argument("--out", default=None)
    p.add_argument("--move", default="redundant", choices=("redundant", "all"),
                   help="redundant: the redundant slots get other replicas; all: every slot another expert")
    p.add_argument("--mem-fraction-static", type=float, default=0.6)
    p.add_argument("--model-path", default="benchmarks/configs/deepseek-v2-lite")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default=None, choices=(None, "fp8"),
                   help="fp8: the experts in DeepSeek's block FP8 (quantized at load), moved with their scales")
    p.add_argument("--staging-max-mb", type=float, default=None,
                   help="--eplb-staging-max-mb: the bound on the prepare phase's device staging")
    a = p.parse_args()
    args = ServerArgs(model_path=a.model_path, load_format=a.load_format, dtype=a.dtype,
                      context_length=4096, mem_fraction_static=a.mem_fraction_static, max_running_requests=a.batch,
                      enable_eplb=True, eplb_rebalance_num_iterations=10**9, ep_num_redundant_experts=a.redundant,
                      eplb_rebalance_layers_per_chunk=a.layers_per_chunk, eplb_expert_weights=a.weights,
                      quantization=a.quantization, eplb_staging_max_mb=a.staging_max_mb)
    t0 = time.perf_counter()
    runner = ModelRunner(args)
    startup_s = time.perf_counter() - t0
    reb = runner.rebalancer
    sched = Scheduler(args, runner.num_pages, runner.context_length, [])
    gen = torch.Generator().manual_seed(0)
    for i in range(a.batch):
        prompt = torch.randint(0, runner.vocab_size, (128,), generator=gen).tolist()
        sched.add_request(GenerateReq(f"r{i}", prompt, SamplingParams(max_new_tokens=2000, temperature=0.0,
                                                                      ignore_eos=True)))
    while sched.waiting or sched.chunked:
        run_step(sched, runner)
    for _ in range(10):  # graphs captured, caches warm
        _step(sched, runner)
    baseline = [_step(sched, runner) for _ in range(40)]

    loc = reb.location
    num_layers, slots = loc.physical_to_logical_map.shape
    g = torch.Generator().manual_seed(1)
    # every redundant slot gets another replica (what a rebalance on one GPU does): experts from the host
    target = loc.physical_to_logical_map.clone()
    first = loc.num_logical_experts if a.move == "redundant" else 0
    target[:, first:] = (target[:, first:] + 1 + torch.randint(0, loc.num_logical_experts - 1,
                                                              (num_layers, slots - first), generator=g)
                         ) % loc.num_logical_experts
    if a.move == "all":  # every expert keeps a replica: rotate the first E slots' experts instead
        target[:, :loc.num_logical_experts] = (torch.arange(loc.num_logical_experts) + 1) % loc.num_logical_experts
    target = ExpertLocation.from_placement(target, 1, num_logical_experts=loc.num_logical_experts)
    moved = int((target.physical_to_logical_map != loc.physical_to_logical_map).sum())
    t_start = time.perf_counter()
    reb.rebalance_to(target, from_host=True)
    during = []
    while reb.status() == WORKING:  # the prepare thread uploads; then ready (1), FAILED or SKIPPED
        during.append(_step(sched, runner))
    prepared = reb.status()
    prepare_s = time.perf_counter() - t_start
    stalls_before = reb.report.num_stalls
    execute_steps = []
    while reb.status() != WORKING:  # execute chunk by chunk, then commit
        execute_steps.append(_step(sched, runner))
    stalls = reb.report.stalls_s[stalls_before - reb.report.num_stalls:] if reb.report.num_stalls > stalls_before else []
    after = [_step(sched, runner) for _ in range(40)]
    expert_mib = sum(t[0].nbytes for t in reb.layers[0].slot_weights()) / 2**20  # weights and FP8 scales
    result = {
        "batch": a.batch, "redundant": a.redundant, "move": a.move, "layers_per_chunk": a.layers_per_chunk, "weights": a.weights,
        "quantization": a.quantization, "staging_max_mb": a.staging_max_mb, "staging_bytes": runner.eplb_staging_bytes,
        "startup_s": startup_s, "experts_moved": moved, "moved_gib": moved * expert_mib / 1024,
        "baseline_tok_s": a.batch * len(baseline) / sum(baseline), "prepare_s": prepare_s,
        "during_prepare_steps": len(during),
        "during_prepare_tok_s": a.batch * len(during) / sum(during) if during else None,
        "after_tok_s": a.batch * len(after) / sum(after), "chunks": len(stalls),
        "stall_ms_max": 1e3 * max(stalls) if stalls else None,
        "stall_ms_median": 1e3 * statistics.median(stalls) if stalls else None,
        "rebalances": reb.report.rebalances, "prepared": prepared,
    }
    if result["during_prepare_tok_s"]:
        result["during_over_baseline"] = result["during_prepare_tok_s"] / result["baseline_tok_s"]
    print(json.dumps(result))
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
