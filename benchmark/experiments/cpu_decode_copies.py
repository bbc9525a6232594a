"""Dtype copies in a CPU decode step: aten::_to_copy calls per step (torch.profiler), and the moeserve source lines
that make them (a dispatch mode over as many more steps). A batch of distinct random prompts is prefilled, decoded a few steps to settle, then --steps
decode steps are profiled. Defaults: the tiny V3 that `moeserve bench cpu-compare` runs, in bf16, dummy weights.
  python benchmark/experiments/cpu_decode_copies.py [--batch-size 1] [--steps 5] [--top 30]
"""

import argparse
import collections
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from moeserve.args import ServerArgs
from moeserve.models.default_model import resolve_model_path

COPY_OPS = ("aten::_to_copy",)  # what .to(dtype), .float(), .type_as() run (aten::to is its no-op shell)


class _CopySites(TorchDispatchMode):
    """Counts the dtype copies (aten.to that copies, aten._to_copy) by the innermost moeserve source line that asked for it."""

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # under inference mode the dispatcher sees aten.to itself: count the calls that made a new tensor
        if func.overloadpacket in (torch.ops.aten.to, torch.ops.aten._to_copy) and out is not args[0]:
            frames = [f for f in traceback.extract_stack() if "/moeserve/" in f.filename]
            f = frames[-1] if frames else None
            where = f"{f.filename[f.filename.index('moeserve/'):]}:{f.lineno} {f.line}" if f else "?"
            self.sites[f"{where} ({args[0].dtype} -> {out.dtype})"] += 1
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(p)
    p.set_defaults(model_path="benchmarks/configs/deepseek-v3-tiny-kv512", load_format="dummy", dtype="bfloat16",
                   device="cpu")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=30)
    ns = p.parse_args()
    args = ServerArgs.from_cli_args(ns)
    resolve_model_path(args)
    store = os.path.join(tempfile.mkdtemp(prefix="moeserve-copies-"), "rendezvous")
    dist.init_process_group("gloo", init_method=f"file://{store}", world_size=1, rank=0)

    from moeserve.rank.io_struct import GenerateReq
    from moeserve.rank.model_runner import ModelRunner
    from moeserve.rank.sampling_params import SamplingParams
    from moeserve.rank.scheduler import Scheduler
    from moeserve.rank.steps import StepPipeline

    runner = ModelRunner(args)
    sched = Scheduler(args, runner.num_pages, runner.context_length, [], dp_rank=0,
                      num_draft_tokens=runner.num_draft_tokens, kv_pool=runner.kv_pool)
    steps = StepPipeline(sched, runner, overlap=False)  # one step per call: the counts are per step
    gen = torch.Generator().manual_seed(1)
    for i in range(ns.batch_size):
        ids = torch.randint(0, runner.vocab_size, (ns.input_len,), generator=gen).tolist()
        sched.add_request(GenerateReq(f"r{i}", ids, SamplingParams(max_new_tokens=64, temperature=0.0,
                                                                   ignore_eos=True)))
    while sched.waiting or sched.chunked:
        steps.step()
    for _ in range(3):
        steps.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(ns.steps):
            steps.step()
    copies = [e for e in prof.events() if e.name in COPY_OPS]
    with _CopySites() as sites:  # the same number of steps again, for where the copies come from
        for _ in range(ns.steps):
            steps.step()
    by_line = sites.sites
    print(f"{args.dtype}, batch {ns.batch_size}: {len(copies) / ns.steps:.1f} aten::_to_copy per decode step "
          f"({len(copies)} in {ns.steps} steps)")
    for line, n in by_line.most_common(ns.top):
        print(f"{n / ns.steps:6.1f}  {line}")


if __name__ == "__main__":
    main()
