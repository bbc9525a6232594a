"""Host time of the scheduler alone (no model, no device): schedule() of a prefill of B distinct random prompts of
L tokens, median over repeats. On a GPU a prefill step's own scheduling is device idle time. Usage:
  python scripts/schedule_host_time.py [--batch-size 4] [--input-len 2048] [--repeat 9]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moeserve.args import ServerArgs  # noqa: E402
from moeserve.models.default_model import default_model_path  # noqa: E402
from moeserve.rank.io_struct import GenerateReq  # noqa: E402
from moeserve.rank.sampling_params import SamplingParams  # noqa: E402
from moeserve.rank.scheduler import Scheduler  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--num-pages", type=int, default=1_400_000)  # an H200's KV pool for V2-Lite at page size 1
    a = p.parse_args()
    args = ServerArgs(model_path=default_model_path(), chunked_prefill_size=a.batch_size * a.input_len,
                      context_length=a.input_len + 64)
    gen = torch.Generator().manual_seed(0)
    prefill = []
    for rep in range(a.repeat):
        sched = Scheduler(args, a.num_pages, args.context_length, [], dp_rank=0)
        for i in range(a.batch_size):
            ids = torch.randint(0, 3000, (a.input_len,), generator=gen).tolist()
            sched.add_request(GenerateReq(f"r{rep}-{i}", ids, SamplingParams(max_new_tokens=8, ignore_eos=True)))
        t = time.perf_counter()
        batch = sched.schedule()
        prefill.append(time.perf_counter() - t)
        assert batch is not None and batch.forward.num_tokens == a.batch_size * a.input_len
    print(f"schedule() of a {a.batch_size} x {a.input_len} prefill: median {statistics.median(prefill) * 1e3:.2f} ms "
          f"over {a.repeat} (min {min(prefill) * 1e3:.2f})")


if __name__ == "__main__":
    main()
