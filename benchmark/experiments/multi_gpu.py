"""Expert parallelism over NCCL on several GPUs: each parallel configuration against the single-GPU run.

float32, on the embedded DeepSeek-V3-architecture model: greedy tokens must equal the single-GPU run's, for
every dispatch backend and DeepEP mode, with DP attention on and off and two-batch overlap on and off.
bfloat16: the same model cast to bf16; tokens are compared, and so are the log-probabilities of the tokens both
runs chose (up to their first difference): a parallel bf16 run may differ from the single-GPU bf16 run by at most
twice what the single-GPU bf16 run differs from float32 (bf16's own error on this model), and never more than
BF16_LOGPROB_TOL. One line per configuration; exits 1 if any check fails.

    python3 benchmark/experiments/multi_gpu.py 2        # on a machine with 2 GPUs
"""

import sys
import time

import torch

from moeserve.server.engine import Engine

BF16_LOGPROB_TOL = 0.25  # nats per token; bf16 logits near 7 in size are spaced 0.03 apart


def max_logprob_diff(ids_a, lps_a, ids_b, lps_b) -> float:
    """Largest |logprob difference| over the tokens two runs share, each sequence up to its first difference."""
    worst = 0.0
    for a, b, la, lb in zip(ids_a, ids_b, lps_a, lps_b, strict=True):
        k = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        worst = max([worst, *(abs(x - y) for x, y in zip(la[:k], lb[:k], strict=True))])
    return worst


def configs(n: int) -> list[tuple[str, dict]]:
    tbo = dict(enable_two_batch_overlap=True, tbo_token_threshold=4)  # decode batches of 8 split too
    dp = dict(dp_size=n, enable_dp_attention=True)
    a2a = dict(moe_a2a_backend="all2all")
    return [
        (f"tp{n} allgather", dict(tp_size=n, moe_a2a_backend="allgather")),
        (f"tp{n} dp{n} allgather", dict(tp_size=n, moe_a2a_backend="allgather", **dp)),
        (f"tp{n} all2all normal", dict(tp_size=n, **a2a, deepep_mode="normal")),
        (f"tp{n} all2all low_latency", dict(tp_size=n, **a2a, deepep_mode="low_latency", ep_max_tokens_per_rank=8)),
        (f"tp{n} all2all auto", dict(tp_size=n, **a2a, deepep_mode="auto")),
        (f"tp{n} dp{n} all2all normal", dict(tp_size=n, **dp, **a2a, deepep_mode="normal")),
        (f"tp{n} dp{n} all2all auto", dict(tp_size=n, **dp, **a2a, deepep_mode="auto")),
        (f"tp{n} dp{n} all2all normal tbo", dict(tp_size=n, **dp, **a2a, deepep_mode="normal", **tbo)),
        (f"tp{n} dp{n} all2all auto tbo", dict(tp_size=n, **dp, **a2a, deepep_mode="auto", **tbo)),
        (f"tp{n} all2all auto tbo", dict(tp_size=n, **a2a, deepep_mode="auto", **tbo)),
    ]


def run(kw: dict, prompts: list[list[int]], logprobs: bool) -> tuple[list[list[int]], list[list[float]], float]:
    t0 = time.perf_counter()
    eng = Engine(device="cuda", max_total_tokens=16384, cuda_graph_max_bs=16, **kw)
    start = time.perf_counter() - t0
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=logprobs)
    eng.shutdown()
    ids = [o["output_ids"] for o in outs]
    lps = [[float(v[0] if isinstance(v, (list, tuple)) else v) for v in o["meta_info"].get("output_token_logprobs", [])]
           for o in outs]
    return ids, lps, start


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else torch.cuda.device_count()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 1000, (k,), generator=gen).tolist() for k in (5, 17, 33, 9, 64, 2, 40, 12)]
    failed = 0

    ref, ref32_lp, start = run(dict(tp_size=1, dtype="float32"), prompts, True)
    ref32 = ref
    print(f"{'float32 tp1':34s} start {start:5.1f} s  (reference)", flush=True)
    for name, kw in configs(n):
        outs, _, start = run(dict(kw, dtype="float32"), prompts, False)
        same = sum(a == b for a, b in zip(ref, outs, strict=True))
        failed += same != len(ref)
        print(f"{'float32 ' + name:34s} start {start:5.1f} s  tokens equal to tp1: {same}/{len(ref)}", flush=True)

    ref16, ref16_lp, _ = run(dict(tp_size=1, dtype="bfloat16"), prompts, True)
    noise = max_logprob_diff(ref32, ref32_lp, ref16, ref16_lp)
    tol = min(max(2 * noise, 0.01), BF16_LOGPROB_TOL)
    print(f"{'bfloat16 tp1':34s} max |dlogprob| vs float32 tp1: {noise:.4f}  -> tolerance {tol:.4f}", flush=True)
    for name, kw in [c for c in configs(n) if c[0].endswith((f"dp{n} all2all auto", "all2all auto tbo"))]:
        outs, lp, _ = run(dict(kw, dtype="bfloat16"), prompts, True)
        same = sum(a == b for a, b in zip(ref16, outs, strict=True))
        worst = max_logprob_diff(ref16, ref16_lp, outs, lp)
        failed += worst > tol
        print(f"{'bfloat16 ' + name:34s} tokens equal to bf16 tp1: {same}/{len(ref16)}  max |dlogprob| {worst:.4f}",
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
