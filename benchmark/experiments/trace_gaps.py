"""Where the device idles in a torch-profiler trace (`bench one-batch --profile` writes them, gzipped): the gaps
between device work longer than --min-us, in time order, each with the host ops that ran in it, and the idle time
summed by the outermost host op that covered it (`(python)` where no op did: the interpreter between ops).
  python3 benchmark/experiments/trace_gaps.py /tmp/prof/one_batch_prefill_bs4.json.gz [--min-us 20] [--top 30]"""

import argparse
import bisect
import gzip
import json
from collections import defaultdict

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--min-us", type=float, default=20.0)
    p.add_argument("--top", type=int, default=30)
    ns = p.parse_args()
    opener = gzip.open if ns.trace.endswith(".gz") else open
    with opener(ns.trace, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    busy = _merge([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in DEVICE_CATS])
    if not busy:
        raise SystemExit("no device events in the trace")
    host = sorted((e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "user_annotation")),
                  key=lambda e: (e["ts"], -e["dur"]))
    outer, end = [], -1.0  # the outermost host ops: not inside another
    for e in host:
        if e.get("cat") == "cpu_op" and e["ts"] >= end:
            outer.append(e)
            end = e["ts"] + e["dur"]
    starts = [e["ts"] for e in outer]
    gaps = [(a[1], b[0]) for a, b in zip(busy, busy[1:], strict=False) if b[0] - a[1] >= ns.min_us]
    if outer and outer[0]["ts"] < busy[0][0]:  # the host's lead before the first device work
        gaps.insert(0, (outer[0]["ts"], busy[0][0]))
    if outer and max(o["ts"] + o["dur"] for o in outer) > busy[-1][1]:  # and its tail after the last
        gaps.append((busy[-1][1], max(o["ts"] + o["dur"] for o in outer)))
    t0, t1 = min(busy[0][0], gaps[0][0] if gaps else busy[0][0]), busy[-1][1]
    by_op: dict[str, float] = defaultdict(float)
    print(f"device busy {sum(e - s for s, e in busy) / 1e3:.2f} ms of {(t1 - t0) / 1e3:.2f} ms; "
          f"{len(gaps)} gaps of {ns.min_us:.0f} us or more, {sum(e - s for s, e in gaps) / 1e3:.2f} ms")
    rows = []
    for s, e in gaps:
        i = max(bisect.bisect_right(starts, s) - 1, 0)
        covered, names = 0.0, []
        for op in outer[i:]:
            if op["ts"] >= e:
                break
            ov = min(e, op["ts"] + op["dur"]) - max(s, op["ts"])
            if ov > 0:
                by_op[op["name"]] += ov
                covered += ov
                names.append(op["name"])
        by_op["(python)"] += (e - s) - covered
        rows.append((s, e, names))
    print("idle time by the outermost host op covering it:")
    for name, us in sorted(by_op.items(), key=lambda kv: -kv[1])[:ns.top]:
        print(f"  {us / 1e3:8.3f} ms  {name[:100]}")
    print(f"the {ns.top} longest gaps, in time order (ms from the first device work):")
    for s, e, names in sorted(sorted(rows, key=lambda r: r[0] - r[1])[:ns.top]):
        print(f"  at {(s - t0) / 1e3:8.3f}  {(e - s):8.1f} us  {', '.join(dict.fromkeys(names))[:150]}")


if __name__ == "__main__":
    main()
