"""Profile decode steps of a DeepSeek-V2-Lite-shaped dummy model on the GPU: where does a step's time go?"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from moeserve.args import ServerArgs
from moeserve.rank.io_struct import GenerateReq
from moeserve.rank.model_runner import ModelRunner
from moeserve.rank.sampling_params import SamplingParams
from moeserve.rank.scheduler import Scheduler
from moeserve.rank.worker import run_step

bs = int(sys.argv[1]) if len(sys.argv) > 1 else 64
args = ServerArgs(model_path="benchmarks/configs/deepseek-v2-lite", load_format="dummy", dtype="bfloat16",
                  context_length=4096, mem_fraction_static=0.5, max_running_requests=bs)
runner = ModelRunner(args)
sched = Scheduler(args, runner.num_pages, runner.context_length, [])
for i in range(bs):
    sched.add_request(GenerateReq(f"r{i}", list(range(2, 130)), SamplingParams(max_new_tokens=200, temperature=0,
                                                                               ignore_eos=True)))
run_step(sched, runner)
for _ in range(5):
    run_step(sched, runner)
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(10):
    run_step(sched, runner)
torch.cuda.synchronize()
print(f"batch {bs}: decode step {1000 * (time.perf_counter() - t) / 10:.1f} ms")
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        run_step(sched, runner)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
