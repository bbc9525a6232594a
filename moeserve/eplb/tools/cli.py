"""`moeserve eplb ...`: synthesize, analyze and simulate expert loads, and plan deployments.

moeserve eplb synth --dist zipf --layers 58 --experts 256 --steps 200 --tokens-per-step 8192 --topk 8 --out w.pt
moeserve eplb analyze w.pt --out report/ --nodes 4 --redundant 32
moeserve eplb simulate w.pt --out sim/ --nodes 1,2,4,9 --redundant 0,32 --tokens-per-gpu 128,1024,16384
moeserve eplb plan --model deepseek-v3 --gpu h100 --num-gpus 72 --batch-per-gpu 256 --context-len 2000
moeserve eplb plan --calibration
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

logger = logging.getLogger("moeserve.eplb")


def int_list(text: str) -> list[int]:
    """Parse '1,2,4' into [1, 2, 4]."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def flag_values(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """{name: value} of the flags that go on under their own names (into a call, a settings record)."""
    return {name: getattr(args, name) for name in names}


# GpuSpec fields that a --gpu-<field> flag overrides, with their units
GPU_FLAGS = {"bf16_tflops": "dense TFLOP/s", "fp8_tflops": "dense TFLOP/s", "hbm_tbps": "TB/s",
             "hbm_gb": "GB", "nvlink_gbps": "GB/s per direction", "rdma_gbps": "GB/s per GPU"}


def dump_settings(meta: dict, topk: int | None, num_groups: int | None) -> tuple[int, int]:
    """topk and num_groups: the flag if given, else the dump's meta, else 8 and 1."""
    return (topk or int(meta.get("topk", 8)), num_groups or int(meta.get("num_groups", 1)))


# ---------------------------------------------------------------------------------------------------------
# Subcommands
# ---------------------------------------------------------------------------------------------------------


def cmd_synth(args: argparse.Namespace) -> int:
    from moeserve.eplb.tools.workloads import WorkloadSpec, generate, save_dump, spec_meta

    # flags under their own names, but the four sizes
    spec = WorkloadSpec(
        num_layers=args.layers, num_experts=args.experts, num_steps=args.steps, num_groups=args.groups,
        **flag_values(args, "tokens_per_step", "topk", "dist", "zipf_exponent", "lognormal_sigma", "drift",
                      "seq_len", "seq_sigma", "seed"))
    start = time.perf_counter()
    counts = generate(spec)
    path = save_dump(args.out, counts, spec_meta(spec))
    print(
        f"wrote {path}: logical_count {list(counts.shape)} ({spec.dist}, drift {spec.drift}, seed {spec.seed}) "
        f"in {time.perf_counter() - start:.1f} s")
    return 0


def cmd_analyze(args: argparse.Namespace) -> int:
    from moeserve.eplb.tools.analyze import AnalyzeSettings, analyze
    from moeserve.eplb.tools.workloads import load_dump

    counts, meta = load_dump(args.dump)
    topk, groups = dump_settings(meta, args.topk, args.num_groups)
    settings = AnalyzeSettings(num_groups=groups, topk=topk,
                               **flag_values(args, "nodes", "gpus_per_node", "redundant", "top", "window"))
    out = Path(args.out)
    print(analyze(counts, meta, settings, out), end="")
    print(f"wrote {out}/: " + ", ".join(sorted(p.name for p in out.iterdir())))
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from moeserve.eplb.tools.simulate import format_table, simulate, write_outputs
    from moeserve.eplb.tools.workloads import load_dump

    counts, meta = load_dump(args.dump)
    topk, groups = dump_settings(meta, args.topk, args.num_groups)
    # recorded under the flags' names; simulate takes the grids as <name>_grid
    grids = flag_values(args, "nodes", "gpus_per_node", "redundant", "tokens_per_gpu")
    runs = flag_values(args, "holdout_chunks", "max_batches", "seed")
    rows = simulate(counts, topk=topk, num_groups=groups, **{f"{k}_grid": v for k, v in grids.items()},
                    **runs, progress=not args.quiet)
    settings = dict(dump=str(args.dump), topk=topk, num_groups=groups, **grids, **runs)
    if not rows:
        print("no deployment could be simulated (see the log lines above)", file=sys.stderr)
        return 1
    print(format_table(rows))
    paths = write_outputs(rows, Path(args.out), settings)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from moeserve.eplb.tools.plan import Deployment, plan_step
    from moeserve.eplb.tools.plan_calibration import fit_efficiency, format_calibration, run_calibration
    from moeserve.eplb.tools.plan_hardware import gpu_spec
    from moeserve.eplb.tools.plan_models import load_model
    from moeserve.eplb.tools.plan_report import format_plan

    if args.calibration:
        eff = fit_efficiency() if args.fit else None
        rows = run_calibration(eff) if eff else run_calibration()
        print(format_calibration(rows, eff) if eff else format_calibration(rows))
        if eff:
            print(f"\nfitted: {eff}")
        return 0
    model = load_model(args.model)
    gpu = gpu_spec(args.gpu, **{name: getattr(args, f"gpu_{name}") for name in GPU_FLAGS})
    phases = ("decode", "prefill") if args.phase == "both" else (args.phase,)
    # every Deployment field is the flag of its name, but these three
    set_apart = ("phase", "eplb", "mtp_draft")
    flags = flag_values(args, *(f.name for f in fields(Deployment) if f.name not in set_apart))
    results = []
    for phase in phases:
        dep = Deployment(**flags, phase=phase, eplb=not args.no_eplb,
                         mtp_draft=args.mtp_draft if phase == "decode" else 0)
        result = plan_step(model, gpu, dep)
        print(format_plan(model, gpu, dep, result))
        results.append({"deployment": asdict(dep), "result": asdict(result)})
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"model": asdict(model), "gpu": asdict(gpu), "plans": results},
                                              indent=1))
        print(f"wrote {args.json}")
    return 0


# ---------------------------------------------------------------------------------------------------------
# Parser
# ---------------------------------------------------------------------------------------------------------


def add_dump_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("dump",
                   help="recorder dump: .pt {logical_count [steps, layers, experts], meta}, .npy or .npz")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--topk", type=int, default=None, help="experts per token (default: dump meta, else 8)")
    p.add_argument("--num-groups", type=int, default=None,
                   help="expert groups for EPLB's hierarchical policy (default: dump meta, else 1)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeserve eplb", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log skipped configurations and details")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("synth", help="write a synthetic expert-load dump")
    p.add_argument("--dist", choices=("zipf", "lognormal", "uniform"), default="zipf")
    p.add_argument("--layers", type=int, default=58, help="MoE layers")
    p.add_argument("--experts", type=int, default=256, help="logical experts per layer")
    p.add_argument("--steps", type=int, default=200, help="forward passes")
    p.add_argument("--tokens-per-step", type=int, default=8192)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--zipf-exponent", type=float, default=0.55, help="share of rank r ∝ r^-s")
    p.add_argument("--lognormal-sigma", type=float, default=1.0)
    p.add_argument("--drift", type=float, default=0.01, help="per-step std of the log-popularity random walk")
    p.add_argument("--seq-len", type=int, default=1,
                   help="tokens per sequence in a step (1: independent tokens)")
    p.add_argument("--seq-sigma", type=float, default=1.0, help="per-sequence log-popularity noise")
    p.add_argument("--groups", type=int, default=8, help="expert groups recorded in meta (DeepSeek-V3: 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output file (.pt, .npy or .npz)")
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("analyze", help="heat map, hot/cold experts, balancedness over time")
    add_dump_flags(p)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--redundant", type=int, default=32, help="redundant expert slots (EPLB)")
    p.add_argument("--top", type=int, default=5, help="hot and cold experts listed per layer")
    p.add_argument("--window", type=int, default=0, help="steps per EPLB re-plan (0: steps / 8)")
    p.set_defaults(func=cmd_analyze)

    p = sub.add_parser("simulate", help="balancedness over nodes x GPUs x redundancy x tokens per GPU")
    add_dump_flags(p)
    p.add_argument("--nodes", type=int_list, default=[1, 2, 4, 9, 18], help="comma list")
    p.add_argument("--gpus-per-node", type=int_list, default=[8], help="comma list")
    p.add_argument("--redundant", type=int_list, default=[0, 32], help="comma list")
    p.add_argument("--tokens-per-gpu", type=int_list, default=[64, 256, 1024, 4096, 16384], help="comma list")
    p.add_argument("--holdout-chunks", type=int, default=4, help="time spans: plan on span k, score on k+1")
    p.add_argument("--max-batches", type=int, default=64, help="simulated steps kept per batch size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("plan", help="step-time model: tokens/s per GPU and node, with a breakdown")
    p.add_argument("--calibration", action="store_true", help="print the model against published figures")
    p.add_argument("--fit", action="store_true", help="with --calibration: refit the fitted constants first")
    p.add_argument("--model", default="deepseek-v3",
                   help="preset (deepseek-v3, deepseek-v2-lite, qwen3-235b-a22b) or a Hugging Face "
                   "config.json path")
    p.add_argument("--gpu", default="h100", help="h100, h800 or h200")
    for name, unit in GPU_FLAGS.items():
        p.add_argument(f"--gpu-{name.replace('_', '-')}", type=float, default=None,
                       help=f"override the preset ({unit})")
    p.add_argument("--num-gpus", type=int, default=72)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--ep-size", type=int, default=0, help="GPUs per EP group (0: all)")
    p.add_argument("--redundant", type=int, default=32)
    p.add_argument("--phase", choices=("decode", "prefill", "both"), default="both")
    p.add_argument("--batch-per-gpu", type=int, default=256, help="decode: sequences per GPU")
    p.add_argument("--context-len", type=int, default=2000, help="decode: KV length")
    p.add_argument("--tokens-per-gpu", type=int, default=16384, help="prefill: tokens per GPU per step")
    p.add_argument("--input-len", type=int, default=2000, help="prefill: prompt length")
    p.add_argument("--cache-hit", type=float, default=0.0, help="prefill: fraction of prompt tokens cached")
    p.add_argument("--dispatch", choices=("auto", "normal", "low_latency"), default="auto")
    p.add_argument("--tbo", action=argparse.BooleanOptionalAction, default=True, help="two-batch overlap")
    p.add_argument("--no-eplb", action="store_true", help="experts without a load balancer")
    p.add_argument("--balancedness", type=float, default=None,
                   help="mean/max GPU load (default: simulated on the synthetic workload)")
    p.add_argument("--mtp-draft", type=int, default=0, help="decode: MTP draft tokens per step")
    p.add_argument("--mtp-accept", type=float, default=0.8, help="decode: accepted tokens per draft token")
    p.add_argument("--json", default=None, help="also write the plans to this JSON file")
    p.set_defaults(func=cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `moeserve eplb` with argv (without the leading 'eplb'); returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"moeserve eplb {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
