"""Synthetic workloads: deterministic, right shape and sums, and the dump format round-trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeserve.eplb.tools.workloads import (
    WorkloadSpec,
    capped_shares,
    generate,
    load_dump,
    save_dump,
    spec_meta,
)

SMALL = dict(num_layers=3, num_experts=16, num_steps=10, tokens_per_step=200, topk=4)


@pytest.mark.parametrize("dist", ["zipf", "lognormal", "uniform"])
def test_shape_sum_and_determinism(dist: str) -> None:
    spec = WorkloadSpec(dist=dist, **SMALL)
    counts = generate(spec)
    assert counts.shape == (10, 3, 16) and counts.dtype == np.int64
    assert (counts >= 0).all()
    assert (counts.sum(-1) == 200 * 4).all()  # every (step, layer): tokens * topk routed pairs
    np.testing.assert_array_equal(counts, generate(spec))
    assert not np.array_equal(counts, generate(WorkloadSpec(dist=dist, seed=1, **SMALL)))


def test_sequences_keep_the_sum_and_add_imbalance() -> None:
    base = dict(num_layers=2, num_experts=32, num_steps=40, tokens_per_step=1024, topk=4, dist="uniform")
    independent = generate(WorkloadSpec(**base))
    grouped = generate(WorkloadSpec(**base, seq_len=256, seq_sigma=1.0))
    assert (grouped.sum(-1) == 1024 * 4).all()
    # 4 sequences per step that each prefer their own experts spread the per-step loads far more
    assert grouped.std(-1).mean() > 2 * independent.std(-1).mean()


def test_layers_permuted_independently_and_drift_moves_loads() -> None:
    spec = WorkloadSpec(num_layers=4, num_experts=64, num_steps=60, tokens_per_step=4096, topk=8, drift=0.0)
    counts = generate(spec)
    hottest = counts.sum(0).argmax(-1)
    assert len(set(hottest.tolist())) > 1  # not the same expert hot in every layer
    drifting = generate(WorkloadSpec(**{**spec.__dict__, "drift": 0.2}))

    def change(c: np.ndarray) -> float:
        first, last = c[:10].sum(0), c[-10:].sum(0)
        return float(np.abs(first / first.sum(-1, keepdims=True) - last / last.sum(-1, keepdims=True)).sum())

    assert change(drifting) > 3 * change(counts)


def test_zipf_skew_and_capped_shares() -> None:
    counts = generate(WorkloadSpec(num_layers=2, num_experts=256, num_steps=5, tokens_per_step=20000, topk=8))
    rel = counts.sum(0) / counts.sum(0).mean(-1, keepdims=True)
    assert 5 < rel.max(-1).mean() < 20  # the default Zipf 0.55: hottest ~10x the mean
    shares = capped_shares(np.array([[10.0, 0.0, 0.0, 0.0, 0.0, 0.0]]), topk=2)
    np.testing.assert_allclose(shares.sum(-1), 1.0)
    assert shares.max() <= 0.5 + 1e-12


def test_bad_spec_raises() -> None:
    with pytest.raises(ValueError, match="dist"):
        generate(WorkloadSpec(dist="pareto", **SMALL))
    with pytest.raises(ValueError, match="topk"):
        generate(WorkloadSpec(num_experts=4, topk=8))


@pytest.mark.parametrize("suffix", [".pt", ".npy", ".npz"])
def test_dump_round_trip(tmp_path, suffix: str) -> None:
    spec = WorkloadSpec(**SMALL)
    counts = generate(spec)
    path = save_dump(tmp_path / f"w{suffix}", counts, spec_meta(spec))
    loaded, meta = load_dump(path)
    np.testing.assert_array_equal(loaded, counts)
    if suffix != ".npy":
        assert meta["topk"] == 4 and meta["source"] == "synthetic"
    if suffix == ".pt":
        raw = torch.load(path, weights_only=True)
        assert raw["logical_count"].dtype == torch.int64  # the SGLang recorder's key


def test_load_sglang_style_and_2d(tmp_path) -> None:
    path = tmp_path / "rec.pt"
    torch.save(
        {
            "rank": 0,
            "logical_count": torch.ones(2, 3, 8, dtype=torch.int32),
            "average_utilization_rate_over_window": None,
        },
        path,
    )
    counts, meta = load_dump(path)
    assert counts.shape == (2, 3, 8) and meta == {}
    np.save(tmp_path / "one.npy", np.ones((3, 8), dtype=np.int64))
    assert load_dump(tmp_path / "one.npy")[0].shape == (1, 3, 8)
    torch.save({"something": 1}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="logical_count"):
        load_dump(tmp_path / "bad.pt")
    with pytest.raises(FileNotFoundError):
        load_dump(tmp_path / "missing.pt")
