"""metrics: GPU loads and balancedness against hand computations, spans, windows, held-out scores."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeserve.eplb.algorithm import rebalance_experts
from moeserve.eplb.metrics import (
    balancedness,
    balancedness_of_loads,
    gpu_loads,
    group_node_span,
    held_out_balancedness,
    node_balancedness,
    windowed_balancedness,
)


def test_gpu_loads_by_hand() -> None:
    weight = torch.tensor([[6.0, 2.0, 4.0]])
    phy2log = torch.tensor([[0, 1, 0, 2]])  # expert 0 has two replicas: 3 tokens each
    loads = gpu_loads(weight, phy2log, None, 2)
    assert loads.tolist() == [[5.0, 7.0]]
    assert balancedness(weight, phy2log, None, 2).tolist() == [6.0 / 7.0]
    assert loads.dtype == torch.float64


def test_readme_reference_balancedness() -> None:
    weight = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                       [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])  # fmt: skip
    phy2log = np.array([[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]])  # fmt: skip
    np.testing.assert_allclose(balancedness(weight, phy2log, None, 8), [0.8277, 0.8050], atol=1e-4)
    assert group_node_span(phy2log, 12, 4, 8, 2).tolist() == [[1] * 4, [1] * 4]


def test_loads_conserve_tokens_and_accept_time_axis() -> None:
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 50, (5, 3, 16))  # [T, L, E]
    phy2log, _, logcnt = rebalance_experts(counts.sum(0), 32, 4, 2, 8)
    loads = gpu_loads(counts, phy2log, logcnt, 8)
    assert loads.shape == (5, 3, 8)
    np.testing.assert_allclose(loads.sum(-1).numpy(), counts.sum(-1))
    assert balancedness(counts, phy2log, logcnt, 8).shape == (5, 3)


def test_zero_load_is_balanced() -> None:
    phy2log = torch.arange(8).view(1, 8)
    assert balancedness(np.zeros((1, 8)), phy2log, None, 4).tolist() == [1.0]
    assert balancedness_of_loads(torch.zeros(2, 3)).tolist() == [1.0, 1.0]


def test_node_balancedness_by_hand() -> None:
    weight = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    phy2log = torch.tensor([[0, 1, 2, 3]])  # 4 GPUs, 2 nodes: node loads 3 and 7
    assert node_balancedness(weight, phy2log, None, 4, 2).tolist() == [5.0 / 7.0]


def test_group_node_span_counts_nodes() -> None:
    # 4 experts in 2 groups on 2 nodes of 2 GPUs; layer 1 puts group 0 on both nodes
    phy2log = torch.tensor([[0, 1, 2, 3], [0, 2, 1, 3]])
    assert group_node_span(phy2log, 4, 2, 4, 2).tolist() == [[1, 1], [2, 2]]


def test_hierarchical_placement_spans_one_node() -> None:
    weight = np.random.default_rng(1).lognormal(0, 1, (4, 32)) * 100
    phy2log, _, _ = rebalance_experts(weight, 48, 8, 4, 16)
    assert (group_node_span(phy2log, 32, 8, 16, 4) == 1).all()


def test_windowed_balancedness_sums_windows() -> None:
    rng = np.random.default_rng(2)
    counts = rng.integers(0, 20, (7, 2, 8))
    phy2log = torch.arange(8).repeat(2, 1)
    out = windowed_balancedness(counts, 3, phy2log, 4)  # 2 full windows, the 7th step dropped
    assert out.shape == (2, 2)
    np.testing.assert_allclose(out[1].numpy(), balancedness(counts[3:6].sum(0), phy2log, None, 4).numpy())


def test_held_out_balancedness_plans_on_previous_window() -> None:
    rng = np.random.default_rng(3)
    counts = rng.integers(1, 100, (8, 2, 16))
    out = held_out_balancedness(counts, 2, 32, 4, 2, 8)
    assert out.shape == (3, 2)
    phy2log, _, logcnt = rebalance_experts(counts[2:4].sum(0), 32, 4, 2, 8)
    np.testing.assert_allclose(out[1].numpy(), balancedness(counts[4:6].sum(0), phy2log, logcnt, 8).numpy())
    assert ((out > 0) & (out <= 1)).all()
    # in-sample is at least as good as held-out on average for a planner that fits the window it sees
    in_sample = torch.stack([balancedness(counts[2 * t : 2 * t + 2].sum(0),
                                          *rebalance_experts(counts[2 * t : 2 * t + 2].sum(0), 32, 4, 2, 8)[::2], 8)
                             for t in range(1, 4)])  # fmt: skip
    assert in_sample.mean() >= out.mean()


def test_unplaced_expert_with_load_raises() -> None:
    with pytest.raises(ValueError, match="no replica"):
        gpu_loads(torch.tensor([[1.0, 1.0, 1.0]]), torch.tensor([[0, 1]]), None, 2)
    with pytest.raises(ValueError, match="split evenly"):
        gpu_loads(torch.tensor([[1.0, 1.0]]), torch.tensor([[0, 1, 1]]), None, 2)
    with pytest.raises(ValueError, match="window"):
        windowed_balancedness(np.ones((2, 1, 2)), 3, torch.tensor([[0, 1]]), 2)
