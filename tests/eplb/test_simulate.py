"""Simulator: placements, re-batching and the sweep on a tiny synthetic dump."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from moeserve.eplb.tools.simulate import (
    EplbPlacement,
    PlainLayout,
    rebatch,
    simulate,
    step_time_balancedness,
    write_outputs,
)
from moeserve.eplb.tools.workloads import WorkloadSpec, generate


@pytest.fixture(scope="module")
def counts() -> np.ndarray:
    spec = WorkloadSpec(
        num_layers=3,
        num_experts=16,
        num_steps=24,
        tokens_per_step=256,
        topk=2,
        dist="lognormal",
        num_groups=4,
        drift=0.02,
    )
    return generate(spec)


def test_placements_route_every_token_once(counts: np.ndarray) -> None:
    from moeserve.eplb.algorithm import rebalance_experts

    weight = torch.from_numpy(counts.sum(0)).float()
    phy2log, _, logcnt = rebalance_experts(weight, 24, 4, 2, 4)
    for placement in (EplbPlacement(phy2log, logcnt, 4), PlainLayout(16, 4), PlainLayout(16, 5)):
        loads = placement.loads(counts)
        assert loads.shape == (24, 3, placement.num_gpus)
        torch.testing.assert_close(loads.sum(-1), torch.from_numpy(counts.sum(-1)).float())
    # the plain layout: expert e on GPU e * P // E
    one_hot = np.zeros((1, 1, 16), dtype=np.int64)
    one_hot[0, 0, 7] = 5
    assert PlainLayout(16, 5).loads(one_hot)[0, 0].tolist() == [0, 0, 5, 0, 0]


def test_step_time_balancedness() -> None:
    assert step_time_balancedness(torch.ones(2, 3, 4)) == (1.0, 1.0)
    assert step_time_balancedness(torch.tensor([[[4.0, 0, 0, 0]]]))[0] == pytest.approx(0.25)
    assert step_time_balancedness(torch.zeros(1, 1, 4)) == (1.0, 1.0)
    # two steps: (1 + 1) / (4 + 1) -- the step-time ratio, not the mean of per-step ratios
    loads = torch.tensor([[[4.0, 0, 0, 0]], [[1.0, 1, 1, 1]]])
    overall, worst = step_time_balancedness(loads)
    assert overall == pytest.approx(2 / 5) and worst == pytest.approx(2 / 5)


def test_rebatch_conserves_tokens(counts: np.ndarray) -> None:
    rng = np.random.default_rng(0)
    # 24 steps of 256 tokens = 12 simulated steps of 512: every recorded step lands whole
    batches, mid = rebatch(counts, 512, topk=2, max_batches=100, rng=rng)
    assert batches.shape == (12, 3, 16)
    np.testing.assert_array_equal(batches.sum(0), counts.sum(0))
    np.testing.assert_allclose(mid, np.arange(12) * 2 + 1.0)
    # smaller than a recorded step: a binomial thinning, about the right size
    small, _ = rebatch(counts, 64, topk=2, max_batches=20, rng=rng)
    assert small.shape[0] == 20
    assert abs(small.sum(-1).mean() - 64 * 2) < 10
    none, _ = rebatch(counts, 10**9, topk=2, max_batches=5, rng=rng)
    assert none.shape[0] == 0


def test_sweep_end_to_end(counts: np.ndarray, tmp_path) -> None:
    rows = simulate(
        counts,
        topk=2,
        num_groups=4,
        nodes_grid=(1, 2),
        gpus_per_node_grid=(2,),
        redundant_grid=(0, 4, 3),
        tokens_per_gpu_grid=(16, 128),
        holdout_chunks=3,
        progress=False,
    )
    # redundant 3 makes 19 slots: not a multiple of the GPUs, skipped
    assert {r.redundant for r in rows} == {0, 4}
    assert len(rows) == 2 * 2 * 2
    for r in rows:
        for value in (r.no_eplb, r.eplb_in_sample, r.eplb_held_out):
            assert 0 < value <= 1
        assert r.eplb_in_sample >= r.no_eplb - 1e-9  # planning on the very loads never loses to no plan
        assert r.heldout_batches > 0
    big = [r for r in rows if r.tokens_per_gpu == 128 and r.redundant == 4 and r.nodes == 2][0]
    small = [r for r in rows if r.tokens_per_gpu == 16 and r.redundant == 4 and r.nodes == 2][0]
    assert big.eplb_in_sample > small.eplb_in_sample  # bigger batches, less noise
    paths = write_outputs(rows, tmp_path, {"note": "test"})
    for path in paths.values():
        assert path.exists() and path.stat().st_size > 0
    data = json.loads(paths["json"].read_text())
    assert len(data["rows"]) == len(rows) and data["settings"] == {"note": "test"}
    assert paths["csv"].read_text().splitlines()[0].startswith("nodes,gpus_per_node")
    assert not any(math.isnan(r.eplb_held_out) for r in rows)


@pytest.mark.parametrize("algorithm", ["auto", "deepseek"])
def test_held_out_is_the_next_windows_balancedness(algorithm: str) -> None:
    """On drifting loads, the held-out number of each algorithm is the balancedness the placement planned on span
    k reaches on the steps of span k+1, recomputed here by hand (numpy, slot by slot)."""
    from moeserve.eplb.algorithm import rebalance_experts, rebalance_experts_reference

    spec = WorkloadSpec(num_layers=2, num_experts=16, num_steps=30, tokens_per_step=128, topk=2,
                        dist="lognormal", num_groups=4, drift=0.2, seed=3)
    counts = generate(spec)
    nodes, gpn, redundant, chunks = 1, 4, 4, 3
    # one simulated step per recorded step: tokens_per_gpu * GPUs = the recorded step's tokens
    rows = simulate(counts, topk=2, num_groups=4, nodes_grid=(nodes,), gpus_per_node_grid=(gpn,),
                    redundant_grid=(redundant,), tokens_per_gpu_grid=(128 // gpn,), holdout_chunks=chunks,
                    max_batches=1000, progress=False)
    (row,) = rows
    plan = {"auto": rebalance_experts, "deepseek": rebalance_experts_reference}[algorithm]
    spans = np.array_split(np.arange(counts.shape[0]), chunks)
    means, maxima, worst = 0.0, 0.0, []
    per_layer = np.zeros((2, counts.shape[1]))
    for k in range(1, chunks):
        phy2log, _, logcnt = plan(torch.as_tensor(counts[spans[k - 1]].sum(0), dtype=torch.float32),
                                  16 + redundant, 4, nodes, gpn)
        phy2log, logcnt = phy2log.numpy(), logcnt.numpy()
        per_gpu = (16 + redundant) // gpn
        for step in spans[k]:
            for layer in range(counts.shape[1]):
                share = counts[step, layer] / logcnt[layer]  # each replica takes an even share
                loads = [sum(share[phy2log[layer, s]] for s in range(g * per_gpu, (g + 1) * per_gpu))
                         for g in range(gpn)]
                means, maxima = means + np.mean(loads), maxima + max(loads)
                per_layer[:, layer] += (np.mean(loads), max(loads))
    worst = min(per_layer[0] / per_layer[1])
    name = "eplb" if algorithm == "auto" else "deepseek"
    assert row.heldout_batches == sum(len(s) for s in spans[1:])
    assert getattr(row, f"{name}_held_out") == pytest.approx(means / maxima, rel=1e-5)
    assert getattr(row, f"{name}_held_out_worst_layer") == pytest.approx(worst, rel=1e-5)
    # the loads drift: a placement does better on the window it was planned on than on the next one
    assert getattr(row, f"{name}_in_sample") > getattr(row, f"{name}_held_out")
