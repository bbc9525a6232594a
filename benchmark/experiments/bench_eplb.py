"""Benchmark our EPLB placement against DeepSeek's reference eplb.py on synthetic expert loads.

The reference is loaded from a copy outside the repository (it is not vendored):

    mkdir -p /tmp/eplb_ref && git --git-dir=<clone of deepseek-ai/EPLB>/.git show HEAD:eplb.py > /tmp/eplb_ref/eplb.py
    .venv/bin/python benchmark/experiments/bench_eplb.py --reference /tmp/eplb_ref/eplb.py --out /tmp/eplb_bench.md   (its table: docs/BENCHMARKS.md, benchmark/results/)

Workloads (generated here, seeded): per layer a base popularity over experts, Zipf (p ~ rank^-a, ranks
shuffled per layer) or lognormal (log p ~ N(0, sigma)); over W windows the log popularity drifts by a
random walk and each window draws `tokens` routed tokens per layer (multinomial). In-sample balancedness
plans on a window and scores the same window; held-out plans on window t and scores window t + 1.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moeserve.eplb.algorithm import is_hierarchical, rebalance_experts  # noqa: E402
from moeserve.eplb.metrics import balancedness  # noqa: E402

Planner = Callable[[torch.Tensor, int, int, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class Config:
    """One deployment: EP size, physical slots per layer and the note on how R was chosen."""

    ep: int
    num_replicas: int
    requested: list[int]  # redundant-expert counts that map to this R
    note: str = ""


def make_workload(dist: str, num_layers: int, num_experts: int, args: argparse.Namespace) -> np.ndarray:
    """Expert loads [W, L, E] float64 (token counts) for W windows."""
    rng = np.random.default_rng(args.seed + (0 if dist == "zipf" else 1))
    if dist == "zipf":
        ranks = np.stack([rng.permutation(num_experts) + 1 for _ in range(num_layers)])
        log_pop = -args.zipf_a * np.log(ranks)
    else:
        log_pop = args.lognormal_sigma * rng.standard_normal((num_layers, num_experts))
    windows = []
    for t in range(args.windows):
        if t:
            log_pop = log_pop + args.drift * rng.standard_normal(log_pop.shape)
        p = np.exp(log_pop - log_pop.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        windows.append(np.stack([rng.multinomial(args.tokens, row) for row in p]))
    return np.stack(windows).astype(np.float64)


def choose_configs(num_experts: int, eps: list[int], redundants: list[int]) -> tuple[list[Config], list[str]]:
    """R = the multiple of EP nearest to E + redundant (ties round up), at least E; one row per (EP, R)."""
    configs: list[Config] = []
    skipped: list[str] = []
    for ep in eps:
        by_r: dict[int, Config] = {}
        for red in redundants:
            want = num_experts + red
            low, high = (want // ep) * ep, -(-want // ep) * ep
            r = low if (want - low < high - want and low >= num_experts) else high
            if r < num_experts:
                skipped.append(
                    f"EP {ep}, {red} redundant: no multiple of {ep} slots >= {num_experts} experts"
                )
                continue
            if r in by_r:
                by_r[r].requested.append(red)
                continue
            by_r[r] = Config(ep, r, [red])
        for cfg in by_r.values():
            if cfg.requested != [cfg.num_replicas - num_experts]:
                cfg.note = (
                    f"redundant {'/'.join(map(str, cfg.requested))} requested -> R={cfg.num_replicas} "
                    f"({cfg.num_replicas - num_experts} redundant), the nearest multiple of EP {ep}"
                )
            configs.append(cfg)
    return configs, skipped


def load_reference(path: str) -> Planner:
    spec = importlib.util.spec_from_file_location("deepseek_eplb_reference", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load the reference from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.rebalance_experts


def run_planner(planner: Planner, windows: np.ndarray, r: int, g: int, n: int, p: int) -> dict[str, float]:
    """Plan on every window; score in-sample and on the next window; time the plans."""
    plans, seconds = [], []
    for w in windows:
        start = time.perf_counter()
        phy2log, _, logcnt = planner(torch.from_numpy(w), r, g, n, p)
        seconds.append(time.perf_counter() - start)
        plans.append((phy2log, logcnt))
    in_sample = torch.stack([balancedness(w, *plan, p) for w, plan in zip(windows, plans, strict=True)])
    held_out = torch.stack([balancedness(windows[t + 1], *plans[t], p) for t in range(len(windows) - 1)])
    per_gpu = [np.sort(plan[0].numpy().reshape(plan[0].shape[0], p, -1), -1) for plan in plans]
    dups = np.mean([(x[..., 1:] == x[..., :-1]).any((1, 2)).mean() for x in per_gpu])
    return {
        "mean": float(in_sample.mean()),
        "min": float(in_sample.amin(1).mean()),  # the worst layer, averaged over windows
        "held_out": float(held_out.mean()) if len(held_out) else float("nan"),
        "seconds": float(np.median(seconds)),
        "dup_layers": float(dups),
        "layers": in_sample,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--reference", help="path of DeepSeek's eplb.py (outside the repo); omit to run ours only"
    )
    parser.add_argument("--layers", type=int, default=58)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--ep", type=int, nargs="+", default=[32, 64, 144, 256])
    parser.add_argument("--redundant", type=int, nargs="+", default=[0, 32, 64])
    parser.add_argument("--dists", nargs="+", default=["zipf", "lognormal"], choices=["zipf", "lognormal"])
    parser.add_argument("--zipf-a", type=float, default=1.0)
    parser.add_argument("--lognormal-sigma", type=float, default=1.0)
    parser.add_argument("--windows", type=int, default=4, help="load windows; held-out scores W - 1 of them")
    parser.add_argument("--tokens", type=int, default=1_000_000, help="routed tokens per layer and window")
    parser.add_argument("--drift", type=float, default=0.2, help="log-popularity random walk step per window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write a markdown report here")
    args = parser.parse_args()

    reference = load_reference(args.reference) if args.reference else None
    configs, skipped = choose_configs(args.experts, args.ep, args.redundant)
    rebalance_experts(np.ones((2, 16)), 32, 4, 2, 8)  # warm up numpy and torch code paths

    header = (
        "| workload | EP | nodes | R (slots/GPU) | policy | ref mean | ref min | ours mean | ours min "
        "| layers better/tie/worse | held-out ref | held-out ours | dup layers ref/ours | s/plan ref | s/plan ours |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    notes = []
    for dist in args.dists:
        windows = make_workload(dist, args.layers, args.experts, args)
        for cfg in configs:
            nodes = max(1, cfg.ep // args.gpus_per_node)
            policy = "hierarchical" if is_hierarchical(args.groups, nodes) else "global"
            size = (cfg.num_replicas, args.groups, nodes, cfg.ep)
            ours = run_planner(rebalance_experts, windows, *size)
            ref = run_planner(reference, windows, *size) if reference else None
            slots = f"{cfg.num_replicas} ({cfg.num_replicas // cfg.ep})"
            row = [dist, str(cfg.ep), str(nodes), slots, policy]
            if ref is not None:
                tol = 1e-9
                b, t, w = (
                    int((ours["layers"] > ref["layers"] + tol).sum()),
                    int(((ours["layers"] - ref["layers"]).abs() <= tol).sum()),
                    int((ours["layers"] < ref["layers"] - tol).sum()),
                )
                row += [
                    f"{ref['mean']:.4f}",
                    f"{ref['min']:.4f}",
                    f"{ours['mean']:.4f}",
                    f"{ours['min']:.4f}",
                ]
                row += [f"{b}/{t}/{w}", f"{ref['held_out']:.4f}", f"{ours['held_out']:.4f}"]
                row += [f"{ref['dup_layers']:.0%}/{ours['dup_layers']:.0%}"]
                row += [f"{ref['seconds']:.2f}", f"{ours['seconds']:.2f}"]
            else:
                row += [
                    "-",
                    "-",
                    f"{ours['mean']:.4f}",
                    f"{ours['min']:.4f}",
                    "-",
                    "-",
                    f"{ours['held_out']:.4f}",
                ]
                row += [f"-/{ours['dup_layers']:.0%}", "-", f"{ours['seconds']:.2f}"]
            lines.append("| " + " | ".join(row) + " |")
            print(lines[-1], flush=True)
            if cfg.note and dist == args.dists[0]:
                notes.append(f"EP {cfg.ep}: {cfg.note}.")

    timing = speed_case(reference)
    command = " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmark/experiments/bench_eplb.py", *sys.argv[1:]])
    report = render(args, command, lines, notes, skipped, timing)
    print(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report)


def speed_case(reference: Planner | None) -> list[str]:
    """Runtime of 61 layers x 256 experts x 288 slots on 32 GPUs in 8 nodes, 8 groups (median of 3)."""
    w = torch.from_numpy(np.random.default_rng(7).lognormal(0, 1, (61, 256)) * 1000)
    out = []
    for name, planner in [("ours", rebalance_experts), ("reference", reference)]:
        if planner is None:
            continue
        times = []
        for _ in range(3):
            start = time.perf_counter()
            planner(w, 288, 8, 8, 32)
            times.append(time.perf_counter() - start)
        out.append(f"{name}: {np.median(times):.3f} s (runs: {', '.join(f'{x:.3f}' for x in times)})")
    return out


def render(
    args, command: str, lines: list[str], notes: list[str], skipped: list[str], timing: list[str]
) -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    machine = f"{os.cpu_count()}-core CPU VM ({platform.machine()}, {platform.python_version()}, torch {torch.__version__})"
    parts = [
        "## EPLB placement: ours vs DeepSeek's reference eplb.py",
        "",
        f"- Command: `{command}`",
        f"- Machine: {machine}; load average at the end {load} (other jobs shared the 2 cores, so runtimes are noisy)",
        f"- Date: {datetime.date.today().isoformat()}",
        f"- Workload: {args.layers} layers x {args.experts} experts, {args.groups} groups, {args.gpus_per_node} GPUs per "
        f"node; Zipf a={args.zipf_a}, lognormal sigma={args.lognormal_sigma}; {args.windows} windows of "
        f"{args.tokens:,} routed tokens per layer, log-popularity drift {args.drift} per window; seed {args.seed}",
        "- Columns: balancedness = mean / max GPU load per layer (1.0 is perfect); *mean* over layers and windows, "
        "*min* = the worst layer, averaged over windows (in-sample: planned and scored on the same window); "
        "*layers better/tie/worse* compare ours with the reference layer by layer over all windows; *held-out* plans "
        "on window t and scores window t + 1; *dup layers* = share of layers where some GPU holds two replicas of "
        "one expert; *s/plan* = median seconds per placement (all layers).",
        "",
        *lines,
        "",
    ]
    if notes or skipped:
        parts += ["Slot counts:", ""] + [f"- {n}" for n in notes + skipped] + [""]
    if timing:
        parts += [
            "Runtime, 61 layers x 256 experts x 288 slots, 32 GPUs in 8 nodes, 8 groups (hierarchical):",
            "",
        ]
        parts += [f"- {t}" for t in timing] + [""]
    return "\n".join(parts)


if __name__ == "__main__":
    main()
