"""analyze: end to end on a tiny dump, files and sane numbers."""

from __future__ import annotations

import csv

import numpy as np

from moeserve.eplb.tools.analyze import (
    AnalyzeSettings,
    analyze,
    balancedness_over_time,
    hot_cold,
    relative_load,
)
from moeserve.eplb.tools.workloads import WorkloadSpec, generate


def tiny() -> np.ndarray:
    return generate(
        WorkloadSpec(
            num_layers=3,
            num_experts=16,
            num_steps=16,
            tokens_per_step=128,
            topk=2,
            dist="zipf",
            zipf_exponent=1.0,
        )
    )


def test_analyze_writes_report(tmp_path) -> None:
    counts = tiny()
    settings = AnalyzeSettings(nodes=2, gpus_per_node=2, redundant=4, num_groups=1, topk=2, top=3, window=4)
    summary = analyze(counts, {"source": "synthetic"}, settings, tmp_path)
    for name in (
        "summary.txt",
        "hot_cold.csv",
        "balancedness.csv",
        "heatmap.png",
        "expert_rank.png",
        "balancedness.png",
    ):
        assert (tmp_path / name).stat().st_size > 0, name
    assert (tmp_path / "summary.txt").read_text() == summary
    assert "16 steps x 3 layers x 16 experts" in summary and "EPLB held out" in summary
    rows = list(csv.DictReader((tmp_path / "hot_cold.csv").open()))
    assert len(rows) == 3 * 2 * 3
    hot0 = [r for r in rows if r["layer"] == "0" and r["kind"] == "hot"]
    assert float(hot0[0]["share"]) >= float(hot0[1]["share"])


def test_balancedness_curves() -> None:
    counts = tiny()
    curves = balancedness_over_time(
        counts, AnalyzeSettings(nodes=1, gpus_per_node=4, redundant=4, topk=2, window=4)
    )
    assert set(curves) == {"no_eplb", "eplb_in_sample", "eplb_held_out"}
    assert all(len(c) == 16 for c in curves.values())
    assert np.isnan(curves["eplb_held_out"][:4]).all() and not np.isnan(curves["eplb_held_out"][4:]).any()
    for c in curves.values():
        values = c[~np.isnan(c)]
        assert ((values > 0) & (values <= 1)).all()
    assert curves["eplb_in_sample"].mean() > curves["no_eplb"].mean()


def test_relative_load_and_hot_cold() -> None:
    counts = np.zeros((2, 1, 4), dtype=np.int64)
    counts[:, 0] = [6, 1, 1, 0]
    np.testing.assert_allclose(relative_load(counts), [[3.0, 0.5, 0.5, 0.0]])
    rows = hot_cold(counts, 1)
    assert [(r["kind"], r["expert"]) for r in rows] == [("hot", 0), ("cold", 3)]


def test_analyze_without_matplotlib_writes_the_rest(tmp_path, monkeypatch, capsys) -> None:
    import moeserve.eplb.tools.analyze as analyze_module

    monkeypatch.setattr(analyze_module, "have_matplotlib", lambda: False)
    settings = AnalyzeSettings(nodes=1, gpus_per_node=4, redundant=4, num_groups=1, topk=2, top=3, window=4)
    analyze(tiny(), {"source": "synthetic"}, settings, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["balancedness.csv", "hot_cold.csv", "summary.txt"]
    assert "moeserve[plot]" in capsys.readouterr().out
