"""Analyze recorded expert loads: heat map, hot and cold experts, balancedness over time with and without EPLB.

Reads a dump (logical_count [steps, layers, experts]) and writes into an output directory:
- heatmap.png: each expert's load relative to its layer's mean (layers x experts), raw and sorted per layer;
- expert_rank.png: relative load against rank, one faint line per layer, the median in bold;
- balancedness.png: balancedness per recorded step at one deployment (nodes x GPUs per node, redundant
  slots) without EPLB, with EPLB planned on the whole recording (in sample), and with EPLB re-planned every
  `window` steps on the previous window (held out, what a rebalancing server would see);
- hot_cold.csv: the `top` hottest and coldest experts of every layer with their shares;
- summary.txt: the numbers (also printed).
Balancedness of a step = sum over layers of the mean GPU load / sum over layers of the max GPU load.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moeserve.eplb.tools.simulate import (
    PlacementCache,
    PlainLayout,
    placement_error,
    step_time_balancedness,
    tokens_per_step,
)
from moeserve.plotting import MISSING, have_matplotlib, pyplot, save_figure

# the three placements scored, by their key in the curves
PLACEMENTS = {"no_eplb": "no EPLB", "eplb_in_sample": "EPLB in sample", "eplb_held_out": "EPLB held out"}


@dataclass
class AnalyzeSettings:
    """The deployment at which balancedness is scored, and how the report is cut."""

    nodes: int = 4
    gpus_per_node: int = 8
    redundant: int = 32
    num_groups: int = 1
    topk: int = 8
    top: int = 5  # hot / cold experts listed per layer
    window: int = 0  # steps per EPLB re-plan for the held-out curve; 0: steps // 8 (at least 1)


def relative_load(logical_count: np.ndarray) -> np.ndarray:
    """Each expert's load over the recording divided by its layer's mean [L, E] (1.0 = perfectly even)."""
    total = logical_count.sum(0).astype(np.float64)
    mean = total.mean(-1, keepdims=True)
    return np.divide(total, mean, out=np.zeros_like(total), where=mean > 0)


def step_balancedness(loads: torch.Tensor) -> np.ndarray:
    """Balancedness of every step [T] from loads [T, L, P]; steps without tokens are NaN."""
    means = loads.mean(-1).sum(-1).double()
    maxima = loads.amax(-1).sum(-1).double()
    out = torch.where(maxima > 0, means / maxima.clamp_min(1e-12), torch.full_like(means, math.nan))
    return out.numpy()


def balancedness_over_time(logical_count: np.ndarray, s: AnalyzeSettings) -> dict[str, np.ndarray]:
    """Per-step balancedness [T] for no EPLB, EPLB in sample and EPLB held out (NaN in the first window)."""
    num_steps, _, num_experts = logical_count.shape
    num_gpus = s.nodes * s.gpus_per_node
    window = s.window or max(1, num_steps // 8)
    spans = max(1, math.ceil(num_steps / window))
    cache = PlacementCache(logical_count, s.num_groups, spans)
    curves = {
        "no_eplb": step_balancedness(PlainLayout(num_experts, num_gpus).loads(logical_count)),
        "eplb_in_sample": step_balancedness(
            cache.get(s.nodes, s.gpus_per_node, s.redundant, None).loads(logical_count)),
    }
    held = np.full(num_steps, math.nan)
    for k in range(1, len(cache.spans)):
        steps = cache.spans[k]
        placement = cache.get(s.nodes, s.gpus_per_node, s.redundant, k - 1)
        held[steps] = step_balancedness(placement.loads(logical_count[steps]))
    curves["eplb_held_out"] = held
    return curves


def hot_cold(logical_count: np.ndarray, top: int) -> list[dict]:
    """Per layer, the `top` hottest and coldest experts as rows {layer, kind, rank, expert, share}."""
    total = logical_count.sum(0).astype(np.float64)
    shares = total / np.maximum(total.sum(-1, keepdims=True), 1)
    rows = []
    for layer, layer_shares in enumerate(shares):
        order = np.argsort(-layer_shares, kind="stable")
        for kind, picks in (("hot", order[:top]), ("cold", order[::-1][:top])):
            for rank, expert in enumerate(picks):
                rows.append({"layer": layer, "kind": kind, "rank": rank, "expert": int(expert),
                             "share": float(layer_shares[expert])})
    return rows


def drift_tv(logical_count: np.ndarray, spans: int = 8) -> float:
    """Mean total-variation distance between consecutive spans' expert shares (0: loads never move)."""
    parts = [p for p in np.array_split(logical_count, min(spans, logical_count.shape[0])) if len(p)]
    if len(parts) < 2:
        return 0.0
    shares = [p.sum(0) / np.maximum(p.sum(0).sum(-1, keepdims=True), 1) for p in parts]
    return float(
        np.mean([0.5 * np.abs(a - b).sum(-1).mean() for a, b in zip(shares, shares[1:], strict=False)]))


def summarize(logical_count: np.ndarray, meta: dict, s: AnalyzeSettings,
              curves: dict[str, np.ndarray]) -> str:
    """The text summary: shape, skew, hottest experts, drift and balancedness at the chosen deployment."""
    num_steps, num_layers, num_experts = logical_count.shape
    rel = relative_load(logical_count)
    step_tokens = tokens_per_step(logical_count, s.topk)
    hottest = np.argsort(-rel, axis=-1)[:, 0]
    lines = [
        f"dump: {num_steps} steps x {num_layers} layers x {num_experts} experts, topk {s.topk}, "
        f"source {meta.get('source', 'recorded')}",
        f"tokens per step: mean {step_tokens.mean():.0f}, min {step_tokens.min():.0f}, max {step_tokens.max():.0f}; "
        f"total {step_tokens.sum():.0f}",
        f"expert load / layer mean over the whole dump: hottest {rel.max(-1).mean():.2f}x (worst layer "
        f"{rel.max():.2f}x, layer {int(rel.max(-1).argmax())}), coldest {rel.min(-1).mean():.3f}x, "
        f"coefficient of variation {rel.std(-1).mean():.3f}",
        f"experts with < 10% of the mean load: {(rel < 0.1).mean() * 100:.1f}%; "
        f"top-10% experts carry {np.sort(rel, -1)[:, -max(1, num_experts // 10) :].sum(-1).mean() / num_experts * 100:.1f}% "
        "of the load",
        f"drift: mean total-variation distance between consecutive eighths of the dump {drift_tv(logical_count):.3f}",
        "most skewed layers (hottest expert): "
        + ", ".join(
            f"layer {i} e{int(hottest[i])} {rel[i, hottest[i]]:.1f}x" for i in np.argsort(-rel.max(-1))[:8])
        + " (every layer in hot_cold.csv)",
        "",
        f"balancedness (mean / max GPU load) at {s.nodes} nodes x {s.gpus_per_node} GPUs = "
        f"EP{s.nodes * s.gpus_per_node}, {s.redundant} redundant experts, groups {s.num_groups}, recorded steps:",
    ]
    for key, label in PLACEMENTS.items():
        values = curves[key][~np.isnan(curves[key])]
        if values.size:
            lines.append(f"  {label:15s} mean {values.mean():.3f}  min {values.min():.3f}  "
                         f"max {values.max():.3f}  ({values.size} steps)")
        else:
            lines.append(f"  {label:15s} n/a (needs more than one window of steps)")
    plain = PlainLayout(num_experts, s.nodes * s.gpus_per_node)
    whole, worst = step_time_balancedness(plain.loads(logical_count.sum(0, keepdims=True)))
    lines.append(f"  whole-dump loads without EPLB: {whole:.3f} (worst layer {worst:.3f}); "
                 "per-step values are lower when batches are small (noise)")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------------------


def plot_heatmap(rel: np.ndarray, path: Path) -> None:
    """Heat map of relative expert load (log colour scale), raw expert order and sorted per layer."""
    from matplotlib.colors import LogNorm

    plt = pyplot()
    clipped = np.clip(rel, 1e-2, None)
    norm = LogNorm(vmin=max(clipped.min(), 1e-2), vmax=max(clipped.max(), 1.01))
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.12 * rel.shape[0] + 3), sharey=True)
    for ax, data, title in (
        (axes[0], clipped, "by expert id"),
        (axes[1], -np.sort(-clipped, axis=-1), "sorted per layer (hot left)"),
    ):
        image = ax.imshow(data, aspect="auto", interpolation="nearest", cmap="magma", norm=norm)
        ax.set_title(f"expert load / layer mean, {title}")
        ax.set_xlabel("expert" if "id" in title else "rank")
    axes[0].set_ylabel("MoE layer")
    fig.colorbar(image, ax=axes, fraction=0.025)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_rank(rel: np.ndarray, path: Path) -> None:
    """Relative load against popularity rank: every layer faint, the median bold."""
    ranked = -np.sort(-rel, axis=-1)
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    for row in ranked:
        ax.plot(row, color="tab:blue", alpha=0.15, lw=0.8)
    ax.plot(np.median(ranked, 0), color="black", lw=2, label="median over layers")
    ax.axhline(1.0, color="gray", ls="--", lw=1, label="even load")
    ax.set_yscale("log")
    ax.set_xlabel("expert rank within its layer")
    ax.set_ylabel("load / layer mean")
    ax.legend()
    ax.grid(alpha=0.3)
    save_figure(fig, path)


def plot_balancedness(curves: dict[str, np.ndarray], s: AnalyzeSettings, path: Path) -> None:
    """Balancedness per recorded step for the three placements."""
    fig, ax = pyplot().subplots(figsize=(9, 4.5))
    for key, label in PLACEMENTS.items():
        ax.plot(curves[key], label=label + (" (previous window)" if key == "eplb_held_out" else ""), lw=1.2)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("recorded step")
    ax.set_ylabel("balancedness (mean / max GPU load)")
    ax.set_title(f"EP{s.nodes * s.gpus_per_node} ({s.nodes} nodes), {s.redundant} redundant experts")
    ax.legend()
    ax.grid(alpha=0.3)
    save_figure(fig, path)


def analyze(logical_count: np.ndarray, meta: dict, s: AnalyzeSettings, out_dir: Path) -> str:
    """Write the plots, hot_cold.csv and summary.txt into out_dir; return the summary text."""
    num_experts = logical_count.shape[-1]
    why = placement_error(num_experts, s.redundant, s.num_groups, s.nodes, s.gpus_per_node)
    if why:
        raise ValueError(f"cannot plan EPLB at {s.nodes} nodes x {s.gpus_per_node} GPUs: {why}")
    out_dir.mkdir(parents=True, exist_ok=True)
    rel = relative_load(logical_count)
    curves = balancedness_over_time(logical_count, s)
    summary = summarize(logical_count, meta, s, curves)
    (out_dir / "summary.txt").write_text(summary)
    with (out_dir / "hot_cold.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["layer", "kind", "rank", "expert", "share"])
        writer.writeheader()
        writer.writerows(hot_cold(logical_count, s.top))
    table = np.stack([np.arange(len(curves["no_eplb"])), *curves.values()], 1)
    np.savetxt(out_dir / "balancedness.csv", table, delimiter=",", header="step," + ",".join(curves),
               comments="", fmt="%.6g")
    if have_matplotlib():
        plot_heatmap(rel, out_dir / "heatmap.png")
        plot_rank(rel, out_dir / "expert_rank.png")
        plot_balancedness(curves, s, out_dir / "balancedness.png")
    else:
        print(f"no heatmap.png, expert_rank.png, balancedness.png: {MISSING}")
    return summary
