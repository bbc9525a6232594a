"""One GPU, the all2all dispatcher compiled in: the low-latency decode step captures in a CUDA graph and the
greedy tokens match the run without a dispatcher. Prints one line per check; exits 1 if one fails."""

import sys

import torch
import torch.distributed as dist

from moeserve.args import ServerArgs
from moeserve.models.default_model import default_model_path
from moeserve.parallel.state import init_parallel_state
from moeserve.rank.io_struct import GenerateReq
from moeserve.rank.model_runner import ModelRunner
from moeserve.rank.sampling_params import SamplingParams
from moeserve.rank.scheduler import Scheduler
from moeserve.rank.steps import run_step
from moeserve.server.launch import free_port

dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0)
init_parallel_state(1, 0, 1, 1)
gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(2, 1000, (n,), generator=gen).tolist() for n in (5, 17, 33, 9, 64, 2, 40, 12)]


def run(**kw):
    args = ServerArgs(model_path=default_model_path(), dtype="bfloat16", max_total_tokens=8192, **kw)
    runner = ModelRunner(args)
    sched = Scheduler(args, runner.num_pages, runner.context_length, [])
    for i, p in enumerate(prompts):
        sched.add_request(GenerateReq(f"r{i}", p, SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)))
    outs: dict[str, list[int]] = {}
    while sched.has_work():
        for o in run_step(sched, runner):
            outs.setdefault(o.rid, []).extend(o.new_token_ids)
    graphs = runner.graph_runner.graphs if runner.graph_runner else {}
    return [outs[f"r{i}"] for i in range(len(prompts))], graphs


ref, _ = run()
ll, graphs = run(moe_a2a_backend="all2all", deepep_mode="low_latency", ep_max_tokens_per_rank=16)
auto, graphs_auto = run(moe_a2a_backend="all2all", deepep_mode="auto", ep_max_tokens_per_rank=16)
ok_graph = bool(graphs) and all(g is not None for g in graphs.values())
same = sum(a == b for a, b in zip(ref, ll, strict=True))
same_auto = sum(a == b for a, b in zip(ref, auto, strict=True))
print(f"low_latency decode graphs captured: {sorted(graphs)} ok={ok_graph}")
print(f"auto decode graphs captured: {sorted(graphs_auto)}")
print(f"greedy sequences equal to the no-dispatcher run: low_latency {same}/{len(ref)}, auto {same_auto}/{len(ref)}")
sys.exit(0 if ok_graph and same == len(ref) and same_auto == len(ref) else 1)
