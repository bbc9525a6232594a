"""Where the host time of a warm eager prefill step goes: cProfile over prefill steps of one prompt each (distinct
random prompts), after warm-up steps of the same size, so no compile or first-use cost is in it. Prints the step's
wall time with and without the profiler and the functions by own time and by cumulative time. On the GPU machine:
  python3 scripts/gpu/prefill_host_profile.py --model-path benchmarks/configs/deepseek-v2-lite --load-format dummy \
    --dtype bfloat16 --context-length 4096 --mem-fraction-static 0.5 --input-len 512
--running N: as in serving, N requests decode (through the overlapped step pipeline) while each prompt arrives;
the prefill steps' wall times, and the profile of the whole loop, are then those of a busy server.
"""

import argparse
import cProfile
import io
import pstats
import time

import torch

from moeserve.args import ServerArgs
from moeserve.rank.io_struct import GenerateReq
from moeserve.rank.model_runner import ModelRunner
from moeserve.rank.sampling_params import SamplingParams
from moeserve.rank.scheduler import Scheduler
from moeserve.rank.steps import StepPipeline, run_step


def main() -> None:
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--running", type=int, default=0)
    ns = p.parse_args()
    args = ServerArgs.from_cli_args(ns)
    runner = ModelRunner(args)
    gen = torch.Generator().manual_seed(0)
    if ns.running:
        return busy(ns, args, runner, gen)

    def prefill_once(tag: str) -> float:
        s = Scheduler(args, runner.num_pages, runner.context_length, [], dp_rank=0)
        ids = torch.randint(0, runner.vocab_size, (ns.input_len,), generator=gen).tolist()
        s.add_request(GenerateReq(tag, ids, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while s.has_work():
            run_step(s, runner)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    for i in range(3):
        prefill_once(f"warm{i}")
    plain = [prefill_once(f"plain{i}") for i in range(ns.steps)]
    prof = cProfile.Profile()
    prof.enable()
    profiled = [prefill_once(f"prof{i}") for i in range(ns.steps)]
    prof.disable()
    print(f"prefill of 1 x {ns.input_len}: {sorted(plain)[len(plain) // 2]:.1f} ms a step (median), "
          f"{sorted(profiled)[len(profiled) // 2]:.1f} ms under cProfile")
    _print_profile(prof)


def _print_profile(prof: cProfile.Profile) -> None:
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(30)
        print("\n".join(line[:170] for line in out.getvalue().splitlines() if line.strip()))


def busy(ns, args: ServerArgs, runner: ModelRunner, gen: torch.Generator) -> None:
    """Prompts arriving one every 4 steps beside ns.running decoding requests, then the same under cProfile."""
    s = Scheduler(args, runner.num_pages, runner.context_length, [], dp_rank=0)
    pipe = StepPipeline(s, runner)
    long = SamplingParams(max_new_tokens=min(runner.context_length - ns.input_len, 1024), temperature=0.0,
                          ignore_eos=True)
    one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)

    def ids() -> list[int]:
        return torch.randint(0, runner.vocab_size, (ns.input_len,), generator=gen).tolist()

    for i in range(ns.running):
        s.add_request(GenerateReq(f"run{i}", ids(), long))

    def rounds(tag: str, n: int) -> dict[str, list[float]]:
        times: dict[str, list[float]] = {}
        for i in range(4 * n):
            if i % 4 == 0:
                s.add_request(GenerateReq(f"{tag}{i}", ids(), one))
            s.stats.launched = None
            t0 = time.perf_counter()
            pipe.step()
            if s.stats.launched is not None:
                times.setdefault(s.stats.launched.name.lower(), []).append((time.perf_counter() - t0) * 1e3)
        return times

    rounds("warm", 6)
    plain = rounds("plain", ns.steps)
    prof = cProfile.Profile()
    prof.enable()
    profiled = rounds("prof", ns.steps)
    prof.disable()
    for label, t in (("plain", plain), ("cProfile", profiled)):
        print(label, ", ".join(f"{m}: {len(v)} steps, median {sorted(v)[len(v) // 2]:.1f} ms, max {max(v):.1f}"
                               for m, v in t.items()))
    _print_profile(prof)


if __name__ == "__main__":
    main()
