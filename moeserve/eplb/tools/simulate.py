"""Simulate expert placements on recorded loads: balancedness over nodes x GPUs x redundancy x batch size.

Method (the SGLang blog's simulator, redone here):

1. Re-batch. The recorded steps are read as one stream of tokens in time order (a step's token count is
   its routed pairs / topk). A simulated step takes the next `tokens_per_gpu * num_gpus` tokens of that
   stream: recorded steps that fall wholly inside are added; a recorded step that straddles a boundary, or
   is larger than a simulated step, contributes a binomial thinning of its counts (each routed pair is kept
   with probability = the fraction of the step's tokens that fall inside), so small simulated batches keep
   the statistical noise of small batches. Token identities are not recorded, so layers are thinned
   independently. When the stream holds more simulated steps than `max_batches`, evenly spaced ones are
   kept.
2. Place. No EPLB: expert e on GPU e * P // E, one copy (the layout without a load balancer). EPLB:
   `rebalance_experts` (DeepSeek's contract) with R = E + redundant slots, R/P slots per GPU, each expert's
   load split evenly over its replicas. In-sample: planned on the whole recording. Held out: the recording
   is cut into `holdout_chunks` equal spans of time; the placement planned on span k is scored on the
   simulated steps whose midpoint lies in span k+1 (as a server that rebalances every span would run): on
   drifting loads (workloads.py's `drift`) the number that says what a rebalance buys. Both --eplb-algorithm
   choices are planned and scored: moeserve's (auto) and DeepSeek's reference policy (deepseek).
3. Score. Per simulated step and layer the GPU loads are summed; balancedness = sum of mean GPU loads / sum
   of max GPU loads over steps and layers, so 1/balancedness is exactly the factor by which imbalance
   stretches the MoE part of the step time. The worst layer's value is reported too.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from moeserve.plotting import MISSING, have_matplotlib, pyplot, save_figure

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------
# Placements and scores
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlainLayout:
    """Experts without a load balancer: expert e wholly on GPU e * P // E (any E, P; no replicas)."""

    num_experts: int
    num_gpus: int

    def loads(self, counts: np.ndarray | torch.Tensor) -> torch.Tensor:
        """GPU loads [B, L, P] float32 of counts [B, L, E]."""
        counts = torch.as_tensor(np.asarray(counts), dtype=torch.float32)
        gpu = torch.arange(self.num_experts) * self.num_gpus // self.num_experts
        out = torch.zeros(*counts.shape[:-1], self.num_gpus)
        return out.index_add_(-1, gpu, counts)


@dataclass(frozen=True)
class EplbPlacement:
    """An EPLB placement: phy2log [L, R] int64 (slot r on GPU r // (R/P)), logcnt [L, E] int64, P GPUs."""

    phy2log: torch.Tensor
    logcnt: torch.Tensor
    num_gpus: int

    def loads(self, counts: np.ndarray | torch.Tensor) -> torch.Tensor:
        """GPU loads [B, L, P] float32 of counts [B, L, E], each expert's load split evenly over its replicas."""
        from moeserve.eplb.metrics import gpu_loads

        counts = torch.as_tensor(np.asarray(counts))
        return gpu_loads(counts, self.phy2log, self.logcnt, self.num_gpus).float()


def step_time_balancedness(loads: torch.Tensor) -> tuple[float, float]:
    """(overall, worst layer) balancedness of loads [B, L, P]: sum of per-step means / sum of per-step maxima.

    1 / overall is the factor by which imbalance stretches the MoE time of these steps (metrics.balancedness
    is the per-layer ratio of one load matrix). Steps with no tokens count for nothing; no tokens at all: 1.0.
    """
    means = loads.mean(-1).double()  # [B, L]
    maxima = loads.amax(-1).double()
    total_max = float(maxima.sum())
    if total_max == 0:
        return 1.0, 1.0
    per_layer = means.sum(0) / maxima.sum(0).clamp_min(1e-12)
    per_layer = torch.where(maxima.sum(0) > 0, per_layer, torch.ones_like(per_layer))
    return float(means.sum()) / total_max, float(per_layer.min())


def plan_placement(weight: np.ndarray | torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                   num_gpus: int, algorithm: str = "auto") -> EplbPlacement:
    """EPLB placement planned on loads weight [L, E] by `algorithm` (an --eplb-algorithm choice: auto is
    rebalance_experts, deepseek the reference policy; both DeepSeek's contract)."""
    from moeserve.eplb.rebalancer import ALGORITHMS

    weight = torch.as_tensor(np.asarray(weight), dtype=torch.float32)
    phy2log, _, logcnt = ALGORITHMS[algorithm](weight, num_replicas, num_groups, num_nodes, num_gpus)
    return EplbPlacement(phy2log, logcnt, num_gpus)


def placement_error(num_experts: int, redundant: int, num_groups: int, num_nodes: int,
                    gpus_per_node: int) -> str:
    """Why this deployment cannot be planned by EPLB, or '' when it can."""
    num_gpus = num_nodes * gpus_per_node
    num_replicas = num_experts + redundant
    if redundant < 0:
        return "redundant experts must be >= 0"
    if num_replicas % num_gpus:
        return f"experts + redundant = {num_replicas} is not a multiple of {num_gpus} GPUs"
    if num_experts % num_groups:
        return f"{num_groups} groups do not divide {num_experts} experts"
    return ""


# ---------------------------------------------------------------------------------------------------------
# Re-batching
# ---------------------------------------------------------------------------------------------------------


def tokens_per_step(logical_count: np.ndarray, topk: int) -> np.ndarray:
    """Tokens in each recorded step [T] float: routed pairs / topk, averaged over layers."""
    return logical_count.sum(-1).mean(-1) / topk


def rebatch(logical_count: np.ndarray, tokens_per_batch: int, topk: int, max_batches: int,
            rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Cut the recorded token stream into simulated steps of `tokens_per_batch` tokens (module docstring).

    Returns (counts int64 [B, L, E], midpoint of each simulated step in recorded-step units [B] float).
    B is 0 when the recording holds fewer tokens than one simulated step.
    """
    step_tokens = tokens_per_step(logical_count, topk)
    bounds = np.concatenate([[0.0], np.cumsum(step_tokens)])
    num_windows = int(bounds[-1] // tokens_per_batch)
    if num_windows == 0:
        return np.zeros((0, *logical_count.shape[1:]), dtype=np.int64), np.zeros(0)
    chosen = np.unique(np.linspace(0, num_windows - 1, min(num_windows, max_batches)).round().astype(int))
    batches = np.empty((len(chosen), *logical_count.shape[1:]), dtype=np.int64)
    midpoints = np.empty(len(chosen))
    for i, window in enumerate(chosen):
        lo, hi = window * tokens_per_batch, (window + 1) * tokens_per_batch
        first = int(np.searchsorted(bounds, lo, side="right")) - 1
        last = int(np.searchsorted(bounds, hi, side="left"))  # exclusive
        acc = np.zeros(logical_count.shape[1:], dtype=np.int64)
        for step in range(first, last):
            size = step_tokens[step]
            if size <= 0:
                continue
            inside = (min(hi, bounds[step + 1]) - max(lo, bounds[step])) / size
            if inside >= 1.0 - 1e-12:
                acc += logical_count[step]
            elif inside > 0:
                acc += rng.binomial(logical_count[step], inside)
        batches[i] = acc
        mid = (lo + hi) / 2
        step = int(np.searchsorted(bounds, mid, side="right")) - 1
        step = min(step, len(step_tokens) - 1)
        midpoints[i] = step + (mid - bounds[step]) / max(step_tokens[step], 1e-12)
    return batches, midpoints


# ---------------------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------------------


@dataclass
class SimRow:
    """One simulated deployment: sizes, how many simulated steps were scored, and the balancedness values."""

    nodes: int
    gpus_per_node: int
    num_gpus: int
    redundant: int
    tokens_per_gpu: int
    batches: int
    heldout_batches: int
    no_eplb: float
    eplb_in_sample: float
    eplb_held_out: float
    no_eplb_worst_layer: float
    eplb_in_sample_worst_layer: float
    eplb_held_out_worst_layer: float
    # the same with DeepSeek's reference policy (--eplb-algorithm deepseek); eplb_* above are moeserve's (auto)
    deepseek_in_sample: float
    deepseek_held_out: float
    deepseek_in_sample_worst_layer: float
    deepseek_held_out_worst_layer: float


class PlacementCache:
    """EPLB placements keyed by (nodes, GPUs per node, redundant, span, algorithm), planned once per key."""

    def __init__(self, logical_count: np.ndarray, num_groups: int, holdout_chunks: int):
        self.logical_count = logical_count
        self.num_groups = num_groups
        self.spans = np.array_split(np.arange(logical_count.shape[0]), holdout_chunks)
        self._cache: dict[tuple[int, int, int, int, str], EplbPlacement] = {}

    def get(self, nodes: int, gpus_per_node: int, redundant: int, span: int | None,
            algorithm: str = "auto") -> EplbPlacement:
        """The placement `algorithm` plans on the whole recording (span None) or on one time span."""
        key = (nodes, gpus_per_node, redundant, -1 if span is None else span, algorithm)
        if key not in self._cache:
            steps = slice(None) if span is None else self.spans[span]
            weight = self.logical_count[steps].sum(0)
            num_experts = weight.shape[-1]
            self._cache[key] = plan_placement(weight, num_experts + redundant, self.num_groups, nodes,
                                              nodes * gpus_per_node, algorithm)
        return self._cache[key]


def simulate_one(batches: np.ndarray, midpoints: np.ndarray, cache: PlacementCache, nodes: int,
                 gpus_per_node: int, redundant: int) -> dict[str, float | int]:
    """Score one deployment on simulated steps: no EPLB; then moeserve's placements (eplb_*) and DeepSeek's
    reference's (deepseek_*), each in sample and held out (planned on span k, scored on span k+1)."""
    num_experts = batches.shape[-1]
    out: dict[str, float | int] = {}
    plain = PlainLayout(num_experts, nodes * gpus_per_node)
    out["no_eplb"], out["no_eplb_worst_layer"] = step_time_balancedness(plain.loads(batches))
    span_of_step = np.zeros(cache.logical_count.shape[0], dtype=int)
    for k, steps in enumerate(cache.spans):
        span_of_step[steps] = k
    batch_span = span_of_step[np.clip(midpoints.astype(int), 0, len(span_of_step) - 1)]
    for name, algorithm in (("eplb", "auto"), ("deepseek", "deepseek")):
        in_sample = cache.get(nodes, gpus_per_node, redundant, None, algorithm).loads(batches)
        out[f"{name}_in_sample"], out[f"{name}_in_sample_worst_layer"] = step_time_balancedness(in_sample)
        held_loads = []  # the placement of span k scores the simulated steps of span k+1
        for k in range(1, len(cache.spans)):
            mask = batch_span == k
            if mask.any():
                placement = cache.get(nodes, gpus_per_node, redundant, k - 1, algorithm)
                held_loads.append(placement.loads(batches[mask]))
        out["heldout_batches"] = int(sum(x.shape[0] for x in held_loads))
        if held_loads:
            out[f"{name}_held_out"], out[f"{name}_held_out_worst_layer"] = step_time_balancedness(
                torch.cat(held_loads))
        else:
            out[f"{name}_held_out"] = out[f"{name}_held_out_worst_layer"] = math.nan
    return out


def simulate(logical_count: np.ndarray, *, topk: int, num_groups: int = 1,
             nodes_grid: Sequence[int] = (1, 2, 4, 9, 18), gpus_per_node_grid: Sequence[int] = (8,),
             redundant_grid: Sequence[int] = (0, 32),
             tokens_per_gpu_grid: Sequence[int] = (64, 256, 1024, 4096, 16384), holdout_chunks: int = 4,
             max_batches: int = 64, seed: int = 0, progress: bool = True) -> list[SimRow]:
    """Sweep deployments over recorded counts [T, L, E]; rows EPLB cannot plan are skipped with a log line."""
    from tqdm import tqdm

    if holdout_chunks < 2:
        raise ValueError("holdout_chunks must be >= 2 (plan on one span, score on the next)")
    num_experts = logical_count.shape[-1]
    if num_experts % num_groups:
        raise ValueError(f"--num-groups {num_groups} does not divide {num_experts} experts")
    cache = PlacementCache(logical_count, num_groups, min(holdout_chunks, logical_count.shape[0]))
    configs = []
    for nodes in nodes_grid:
        for gpn in gpus_per_node_grid:
            for red in redundant_grid:
                why = placement_error(num_experts, red, num_groups, nodes, gpn)
                if why:
                    logger.warning("skip %d nodes x %d GPUs, %d redundant: %s", nodes, gpn, red, why)
                    continue
                configs.extend((nodes, gpn, red, tpg) for tpg in tokens_per_gpu_grid)
    rows: list[SimRow] = []
    batch_cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for nodes, gpn, red, tpg in tqdm(configs, desc="simulate", disable=not progress or len(configs) < 2):
        num_gpus = nodes * gpn
        tokens = tpg * num_gpus
        if tokens not in batch_cache:
            rng = np.random.default_rng([seed, tokens])
            batch_cache[tokens] = rebatch(logical_count, tokens, topk, max_batches, rng)
        batches, midpoints = batch_cache[tokens]
        if batches.shape[0] == 0:
            logger.warning("skip %d GPUs at %d tokens/GPU: the recording holds fewer tokens", num_gpus, tpg)
            continue
        scores = simulate_one(batches, midpoints, cache, nodes, gpn, red)
        rows.append(SimRow(nodes, gpn, num_gpus, red, tpg, batches.shape[0], **scores))
    return rows


# ---------------------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------------------

TABLE_COLUMNS = (
    ("nodes", "nodes", "{:d}"),
    ("gpus_per_node", "gpn", "{:d}"),
    ("num_gpus", "GPUs", "{:d}"),
    ("redundant", "redund", "{:d}"),
    ("tokens_per_gpu", "tok/GPU", "{:d}"),
    ("batches", "steps", "{:d}"),
    ("no_eplb", "no EPLB", "{:.3f}"),
    ("eplb_in_sample", "EPLB in", "{:.3f}"),
    ("eplb_held_out", "EPLB held", "{:.3f}"),
    ("deepseek_in_sample", "DS in", "{:.3f}"),
    ("deepseek_held_out", "DS held", "{:.3f}"),
)


def format_table(rows: Sequence[SimRow]) -> str:
    """A fixed-width text table of the sweep, one row per deployment."""
    header = [title for _, title, _ in TABLE_COLUMNS]
    body = [[fmt.format(getattr(row, key)) for key, _, fmt in TABLE_COLUMNS] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in body]
    return "\n".join(lines)


def write_outputs(rows: Sequence[SimRow], out_dir: Path, settings: dict) -> dict[str, Path]:
    """Write simulate.csv, simulate.json (rows + settings), table.txt and simulate.png into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out_dir / "simulate.csv", "json": out_dir / "simulate.json",
             "table": out_dir / "table.txt", "plot": out_dir / "simulate.png"}
    fields = list(SimRow.__dataclass_fields__)
    with paths["csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    records = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(r).items()}
               for r in rows]
    paths["json"].write_text(json.dumps({"settings": settings, "rows": records}, indent=1))
    paths["table"].write_text(format_table(rows) + "\n")
    if have_matplotlib():
        plot_sweep(rows, paths["plot"])
    else:
        del paths["plot"]
        print(f"no simulate.png: {MISSING}")
    return paths


def plot_sweep(rows: Sequence[SimRow], path: Path) -> None:
    """Balancedness against tokens per GPU, one line per (GPUs, redundant), a panel per placement."""
    panels = {"no_eplb": "no EPLB", "eplb_in_sample": "EPLB, in sample", "eplb_held_out": "EPLB, held out",
              "deepseek_held_out": "DeepSeek's EPLB, held out"}
    fig, axes = pyplot().subplots(1, 4, figsize=(20, 4.5), sharey=True)
    groups = sorted({(r.num_gpus, r.nodes, r.redundant) for r in rows})
    for ax, (key, title) in zip(axes, panels.items(), strict=True):
        for num_gpus, nodes, red in groups:
            sel = sorted((r for r in rows if (r.num_gpus, r.nodes, r.redundant) == (num_gpus, nodes, red)),
                         key=lambda r: r.tokens_per_gpu)
            ax.plot([r.tokens_per_gpu for r in sel], [getattr(r, key) for r in sel], marker="o",
                    label=f"{num_gpus} GPUs / {nodes} nodes, +{red}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per GPU per step")
        ax.set_title(title)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("balancedness (mean / max GPU load)")
    axes[-1].legend(fontsize=7, loc="lower right")
    save_figure(fig, path)
