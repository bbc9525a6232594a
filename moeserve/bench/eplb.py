"""`moeserve bench eplb`: the busiest GPU's routed tokens per pass and the step time, with and without online EPLB,
on a model whose expert load is skewed and drifts.

    moeserve bench eplb --tp-size 4 --dp-size 4 --enable-dp-attention --moe-a2a-backend all2all --phases 4

The model is --model-path (default: the embedded tiny model) with its routing made skewed, in a copy: the tokens
fall into one range per routed expert, the embedding of every token of range e gets a shared direction d_e and
the gate row of expert e gets d_e too, so a prompt drawn from range e routes its tokens to expert e. Phase p draws
its prompts from the ranges of the experts of group p (mod the groups): the hot experts move from phase to phase,
all on one EP rank at start, and a rebalance has something to do after every phase change.

The systems run the same prompts with the same flags and --enable-eplb. The baseline sets
--eplb-min-rebalancing-utilization-threshold 0, so it measures each window and never rebalances; the other
rebalances every --eplb-rebalance-num-iterations passes when it pays; `fake dispatch` routes every token to
experts drawn uniformly at random (--ep-dispatch-algorithm fake), the ceiling of balancing. Figures per phase,
from the windows rank 0 reports: the busiest GPU's routed tokens per pass (averaged over MoE layers),
balancedness, and the wall time per forward pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moeserve.args import ServerArgs
from moeserve.bench.results import append_results
from moeserve.core.model_config import ModelConfig
from moeserve.models.default_model import resolve_model_path


def skewed_checkpoint(src: str, out: Path, strength: float, seed: int = 0) -> list[list[int]]:
    """Copy the checkpoint `src` to `out` with token-aligned routing (see the module doc); the token range of each
    routed expert."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out, dirs_exist_ok=True)
    config = ModelConfig.from_pretrained(out)
    files = sorted(out.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"bench eplb takes a single-file checkpoint, {src} has {len(files)} safetensors files")
    weights = load_file(str(files[0]))
    E, H, V = config.num_experts, config.hidden_size, config.vocab_size
    g = torch.Generator().manual_seed(seed)
    directions = torch.nn.functional.normalize(torch.randn(E, H, generator=g), dim=-1)
    bounds = torch.linspace(8, V, E + 1).long().tolist()
    ranges = [list(range(lo, hi)) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
    embed = weights["model.embed_tokens.weight"]
    scale = float(embed.float().norm(dim=-1).mean())
    for e, tokens in enumerate(ranges):
        embed[tokens] += (strength * scale * directions[e]).to(embed.dtype)
    for key in weights:
        if key.endswith("mlp.gate.weight"):
            weights[key] = weights[key] + strength * directions.to(weights[key].dtype) * H ** 0.5
        if key.endswith("e_score_correction_bias"):
            weights[key] = torch.zeros_like(weights[key])
    save_file(weights, str(files[0]), metadata={"format": "pt"})
    return ranges


def phase_prompts(ranges: list[list[int]], experts: list[int], n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([t for e in experts for t in ranges[e]])
    return [pool[torch.randint(0, len(pool), (length,), generator=g)].tolist() for _ in range(n)]


def run(args: ServerArgs, prompts: list[list[list[int]]], output_len: int) -> list[dict]:
    """One system over the phases: per phase its windows' figures and the wall time per forward pass."""
    from moeserve.server.engine import Engine

    eng = Engine(**dataclasses.asdict(args))
    rows, seen = [], 0
    try:
        params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
        eng.generate(input_ids=prompts[0][:2], sampling_params=params)  # warm-up, outside the figures
        for p, batch in enumerate(prompts):
            report = eng.get_load()[0].eplb
            start_pass, start_rebalances = report.passes, report.rebalances
            t0 = time.perf_counter()
            eng.generate(input_ids=batch, sampling_params=params)
            dt = time.perf_counter() - t0
            report = eng.get_load()[0].eplb
            windows = report.windows[seen:]
            seen = len(report.windows)
            passes = max(report.passes - start_pass, 1)
            rows.append({"phase": p, "windows": len(windows), "rebalances": report.rebalances - start_rebalances,
                         "busiest_tokens_per_pass": statistics.mean(w[2] for w in windows) if windows else None,
                         "balancedness": statistics.mean(w[1] for w in windows) if windows else None,
                         "passes": passes, "step_ms": 1e3 * dt / passes})
    finally:
        eng.shutdown()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moeserve bench eplb", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(p)
    p.add_argument("--phases", type=int, default=4, help="Workload phases; the hot experts move at each.")
    p.add_argument("--prompts-per-phase", type=int, default=48)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--strength", type=float, default=3.0, help="How strongly a token's range picks its expert.")
    p.add_argument("--result-file", default=None, help="Append one JSON line.")
    ns = p.parse_args(argv)
    args = ServerArgs.from_cli_args(ns)

    with tempfile.TemporaryDirectory(prefix="moeserve-bench-eplb-") as tmp:
        ranges = skewed_checkpoint(resolve_model_path(args), Path(tmp) / "model", ns.strength)
        E = len(ranges)
        group = E // max(1, ModelConfig.from_pretrained(Path(tmp) / "model").n_group or 1)
        prompts = [phase_prompts(ranges, [(ph * group + i) % E for i in range(group)], ns.prompts_per_phase,
                                 ns.input_len, seed=ph) for ph in range(ns.phases)]
        base = dataclasses.replace(args, model_path=str(Path(tmp) / "model"), tokenizer_path=None,
                                   skip_tokenizer_init=True, enable_eplb=True)
        systems = {"without EPLB": dataclasses.replace(base, eplb_min_rebalancing_utilization_threshold=0.0),
                   "online EPLB": base,
                   # uniform random routing (meaningless tokens): the balance a perfect EPLB would reach
                   "fake dispatch": dataclasses.replace(base, eplb_min_rebalancing_utilization_threshold=0.0,
                                                        ep_dispatch_algorithm="fake")}
        result = {"args": {k: v for k, v in vars(ns).items() if k in ("tp_size", "dp_size", "moe_a2a_backend",
                                                                        "eplb_rebalance_num_iterations",
                                                                        "ep_num_redundant_experts")},
                  "systems": {name: run(a, prompts, ns.output_len) for name, a in systems.items()}}
    print(f"{'phase':>5} | {'system':<13} | {'busiest GPU tok/pass':>20} | {'balancedness':>12} | "
          f"{'rebalances':>10} | {'ms/pass':>8}")
    for ph in range(ns.phases):
        for name, rows in result["systems"].items():
            r = rows[ph]
            busy = f"{r['busiest_tokens_per_pass']:.1f}" if r["busiest_tokens_per_pass"] is not None else "-"
            bal = f"{r['balancedness']:.3f}" if r["balancedness"] is not None else "-"
            print(f"{ph:>5} | {name:<13} | {busy:>20} | {bal:>12} | {r['rebalances']:>10} | {r['step_ms']:>8.2f}")
    append_results(ns.result_file, [result])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
