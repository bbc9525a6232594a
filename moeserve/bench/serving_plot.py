"""`moeserve bench serving --plot`: one PNG of a run, beside its JSON result. Left: each request's end-to-end
latency and TTFT against the time it was sent (queueing shows as a rising line); middle and right: the TTFT and
inter-token latency distributions (histograms, median and p99 marked)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from moeserve.plotting import pyplot, save_figure


def plot_run(results: list[Any], path: Path, title: str) -> None:
    """results: bench serving's RequestResults (sent_s, latency, ttft, itl in seconds); failed ones are left out."""
    ok = [r for r in results if r.success]
    fig, (over_time, ttft, itl) = pyplot().subplots(1, 3, figsize=(17, 4.5))
    sent = [r.sent_s for r in ok]
    over_time.scatter(sent, [r.latency * 1e3 for r in ok], s=10, label="end-to-end latency")
    over_time.scatter(sent, [r.ttft * 1e3 for r in ok], s=10, marker="x", label="TTFT")
    over_time.set(xlabel="sent at (s since the run began)", ylabel="ms", title="request latency over time")
    over_time.legend()
    _histogram(ttft, [r.ttft * 1e3 for r in ok], "TTFT (ms)")
    _histogram(itl, [g * 1e3 for r in ok for g in r.itl], "inter-token latency (ms)")
    fig.suptitle(title)
    save_figure(fig, path)


def _histogram(ax: Any, values_ms: list[float], label: str) -> None:
    ax.set(xlabel=label, ylabel="count", title=f"{label.split(' (')[0]} distribution")
    if not values_ms:
        ax.text(0.5, 0.5, "none", ha="center", transform=ax.transAxes)
        return
    ax.hist(values_ms, bins=min(50, max(5, len(values_ms) // 4)))
    ordered = sorted(values_ms)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    for value, name, style in ((statistics.median(ordered), "median", "--"), (p99, "p99", ":")):
        ax.axvline(value, color="black", linestyle=style, label=f"{name} {value:.1f} ms")
    ax.legend()
