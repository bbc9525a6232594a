"""Where a multi-turn request's TTFT goes with the hierarchical KV cache: per turn, the median time of the whole
request (one output token, so TTFT with no server around it), of the prefix match (which loads host pages back and
reads storage pages into host), of the forward passes, and of releasing the request (the write-through copies).
In process (Scheduler + ModelRunner, tests/rank/inprocess.py), the embedded model on CPU, one request at a time:
conversations of a shared system prompt and user turns whose histories outgrow a 2,048-token device pool.
    PYTHONPATH=. python benchmark/experiments/hicache_phases.py {off,host,host_file} [--conversations 10] [--page-size 1]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections import defaultdict

from moeserve.rank.sampling_params import SamplingParams
from tests.rank.inprocess import InProcessEngine

MODES = ("off", "host", "host_file")


def _timed(obj, name: str, totals: dict[str, float], label: str) -> None:
    """Wrap obj.name so each call's wall time adds to totals[label]."""
    inner = getattr(obj, name)

    def wrapper(*a, **kw):
        start = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            totals[label] += time.perf_counter() - start

    setattr(obj, name, wrapper)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=MODES)
    p.add_argument("--conversations", type=int, default=10)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--answer-len", type=int, default=32)  # random tokens: the history's uncached tail
    p.add_argument("--page-size", type=int, default=1)
    args = p.parse_args()
    kw: dict = dict(max_total_tokens=2048, disable_overlap_schedule=True, page_size=args.page_size)
    if args.mode != "off":
        kw |= dict(enable_hierarchical_cache=True, hicache_ratio=2.0)
    if args.mode == "host_file":
        kw |= dict(hicache_storage_backend="file",
                   hicache_storage_backend_extra_config=json.dumps({"path": tempfile.mkdtemp()}))
    eng = InProcessEngine(**kw)
    totals: dict[str, float] = defaultdict(float)
    _timed(eng.scheduler.cache, "match_prefix", totals, "match")
    _timed(eng.scheduler.cache, "release", totals, "release")
    _timed(eng.runner, "forward", totals, "forward")
    rng = random.Random(1)
    vocab = eng.runner.vocab_size
    system = [rng.randrange(2, vocab) for _ in range(args.system_len)]
    convs = [list(system) for _ in range(args.conversations)]
    params = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    rows = defaultdict(list)
    for turn in range(args.turns):
        for conv in convs:
            conv += [rng.randrange(2, vocab) for _ in range(args.user_len)]
            before, start = dict(totals), time.perf_counter()
            out = eng.run([list(conv)], params)[0]
            row = {"ttft": time.perf_counter() - start, "cached": out["cached_tokens"], "prompt": len(conv)}
            row |= {k: totals[k] - before.get(k, 0.0) for k in ("match", "forward", "release")}
            rows[turn].append(row)
            conv += [rng.randrange(2, vocab) for _ in range(args.answer_len)]
    eng.close()
    print(f"{'turn':>4} {'prompt':>6} {'cached':>6} {'TTFT':>8} {'match':>8} {'forward':>8} {'release':>8}  (ms, p50)")
    for turn, rs in rows.items():
        def med(k, rs=rs):
            return 1000 * statistics.median(r[k] for r in rs)
        print(f"{turn + 1:>4} {statistics.mean(r['prompt'] for r in rs):>6.0f} "
              f"{statistics.mean(r['cached'] for r in rs):>6.0f} {med('ttft'):>8.1f} {med('match'):>8.1f} "
              f"{med('forward'):>8.1f} {med('release'):>8.1f}")


if __name__ == "__main__":
    main()
