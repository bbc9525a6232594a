"""Expert parallelism over NCCL on several GPUs: greedy tokens of each parallel configuration against the
single-GPU run, on the embedded model (float32). One line per configuration; exits 1 if any differs.

    python3 scripts/gpu/multi_gpu.py 2        # on a machine with 2 GPUs
"""

import sys
import time

import torch

from moeserve.engine.engine import Engine


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else torch.cuda.device_count()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 1000, (k,), generator=gen).tolist() for k in (5, 17, 33, 9, 64, 2, 40, 12)]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    common = dict(device="cuda", max_total_tokens=16384, skip_tokenizer_init=False)
    configs = [
        ("tp1", dict(tp_size=1)),
        (f"tp{n} allgather", dict(tp_size=n, moe_a2a_backend="allgather")),
        (f"tp{n} all2all normal", dict(tp_size=n, moe_a2a_backend="all2all", deepep_mode="normal")),
        (f"tp{n} all2all low_latency", dict(tp_size=n, moe_a2a_backend="all2all", deepep_mode="low_latency",
                                            ep_max_tokens_per_rank=8)),
        (f"tp{n} dp{n} all2all auto", dict(tp_size=n, dp_size=n, enable_dp_attention=True,
                                           moe_a2a_backend="all2all", deepep_mode="auto")),
    ]
    ref = None
    failed = 0
    for name, kw in configs:
        t0 = time.perf_counter()
        eng = Engine(**common, **kw)
        t1 = time.perf_counter()
        outs = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
        t2 = time.perf_counter()
        eng.shutdown()
        if ref is None:
            ref = outs
        same = sum(a == b for a, b in zip(ref, outs, strict=True))
        failed += same != len(ref)
        print(f"{name:28s} start {t1 - t0:5.1f} s  generate {t2 - t1:5.2f} s  equal to tp1: {same}/{len(ref)}",
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
