"""rebalance_experts: valid placements, the DeepSeek README example, never worse than the reference greedy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeserve.eplb.algorithm import (
    is_hierarchical,
    logical_to_physical_map,
    rebalance_experts,
    rebalance_experts_over_window,
)

# DeepSeek EPLB README: weights, R=16, G=4, N=2, P=8 and the reference's placement.
README_WEIGHT = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
]
README_PHY2LOG = [
    [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
    [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
]


# ---------------------------------------------------------------------------------------------------------
# Independent helpers: plain Python, written for the tests
# ---------------------------------------------------------------------------------------------------------


def gpu_max_load(weight: np.ndarray, phy2log: np.ndarray, num_gpus: int) -> np.ndarray:
    """Per layer, the load of the most loaded GPU (each expert's load split evenly over its replicas)."""
    weight = np.asarray(weight, dtype=np.float64)
    out = []
    for w, row in zip(weight, np.asarray(phy2log), strict=True):
        counts = np.bincount(row, minlength=len(w))
        slot_load = w[row] / counts[row]
        out.append(slot_load.reshape(num_gpus, -1).sum(1).max())
    return np.array(out)


def balancedness_of(weight: np.ndarray, phy2log: np.ndarray, num_gpus: int) -> np.ndarray:
    return np.asarray(weight, dtype=np.float64).sum(1) / num_gpus / gpu_max_load(weight, phy2log, num_gpus)


def _greedy_pack(items: list[float], num_packs: int) -> list[list[int]]:
    """Heaviest item first into the lightest pack that still has room (lowest index on ties)."""
    per_pack = len(items) // num_packs
    if per_pack == 1:
        return [[i] for i in range(len(items))]
    order = torch.tensor(items, dtype=torch.float32).sort(descending=True).indices.tolist()
    packs: list[list[int]] = [[] for _ in range(num_packs)]
    load = [torch.tensor(0.0)] * num_packs  # float32 sums, as the reference accumulates
    for i in order:
        open_packs = [p for p in range(num_packs) if len(packs[p]) < per_pack]
        best = min(open_packs, key=lambda p: float(load[p]))
        packs[best].append(i)
        load[best] = load[best] + torch.tensor(items[i], dtype=torch.float32)
    return packs


def oracle_reference(weight: np.ndarray, R: int, G: int, N: int, P: int) -> np.ndarray:
    """A slow re-statement of DeepSeek's greedy EPLB (its README's algorithm) -> phy2log [L, R]."""
    if G % N:
        G = N = 1
    w32 = torch.as_tensor(np.asarray(weight)).float()
    E = w32.shape[1]
    out = []
    for w in w32:
        group_load = w.view(G, E // G).sum(1).tolist()
        node_groups = _greedy_pack(group_load, N)
        row = []
        for groups in node_groups:  # each node: its groups' experts, replicated, packed to its GPUs
            experts = [g * (E // G) + k for g in groups for k in range(E // G)]
            local_w = w[experts]
            cnt = torch.ones(len(experts))
            items = list(range(len(experts)))
            for _ in range(R // N - len(experts)):
                e = int((local_w / cnt).argmax())
                items.append(e)
                cnt[e] += 1
            item_load = [float(local_w[e] / cnt[e]) for e in items]
            for gpu in _greedy_pack(item_load, P // N):
                row += [experts[items[i]] for i in gpu]
        out.append(row)
    return np.array(out)


def assert_valid(weight, R, G, N, P, phy2log, log2phy, logcnt) -> None:
    """The contract: shapes, dtypes, counts, inverse maps; hierarchical placements keep groups on a node."""
    L, E = np.asarray(weight).shape
    for t in (phy2log, log2phy, logcnt):
        assert t.dtype == torch.int64 and t.device.type == "cpu"
    assert phy2log.shape == (L, R) and logcnt.shape == (L, E)
    assert log2phy.shape == (L, E, int(logcnt.max()))
    assert int(logcnt.min()) >= 1 and (logcnt.sum(1) == R).all()
    assert (torch.stack([torch.bincount(r, minlength=E) for r in phy2log]) == logcnt).all()
    for layer in range(L):
        for e in range(E):
            slots = log2phy[layer, e]
            c = int(logcnt[layer, e])
            assert (phy2log[layer, slots[:c]] == e).all()
            assert (slots[c:] == -1).all()
    if is_hierarchical(G, N):
        slot_node = np.arange(R) // (R // N)
        group = phy2log.numpy() // (E // G)
        for layer in range(L):
            for g in range(G):
                assert len(set(slot_node[group[layer] == g])) == 1, f"group {g} of layer {layer} spans nodes"
            for n in range(N):  # every node holds G / N whole groups
                assert len(set(group[layer, slot_node == n])) == G // N


# ---------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------


def test_oracle_reproduces_readme() -> None:
    assert oracle_reference(np.array(README_WEIGHT), 16, 4, 2, 8).tolist() == README_PHY2LOG


def test_readme_example_at_least_as_balanced_as_reference() -> None:
    w = torch.tensor(README_WEIGHT)
    out = rebalance_experts(w, 16, 4, 2, 8)
    assert_valid(w, 16, 4, 2, 8, *out)
    ref = balancedness_of(w, np.array(README_PHY2LOG), 8)
    np.testing.assert_allclose(ref, [0.828, 0.805], atol=5e-4)  # as DeepSeek's numbers, rounded
    ours = balancedness_of(w, out[0].numpy(), 8)
    assert (ours >= ref - 1e-12).all()


def test_readme_example_global_policy() -> None:
    w = torch.tensor(README_WEIGHT)
    out = rebalance_experts(w, 16, 3, 2, 8)  # 3 % 2 != 0: global
    assert_valid(w, 16, 3, 2, 8, *out)
    ref = balancedness_of(w, oracle_reference(w.numpy(), 16, 3, 2, 8), 8)
    assert (balancedness_of(w, out[0].numpy(), 8) >= ref - 1e-12).all()


@st.composite
def problems(draw):
    N = draw(st.integers(1, 4))
    G = N * draw(st.integers(1, 3)) if draw(st.booleans()) else draw(st.integers(1, 6))
    E = G * draw(st.integers(1, 4))
    P = N * draw(st.integers(1, 4))
    S = draw(st.integers(max(1, -(-E // P)), max(1, -(-E // P)) + 3))  # enough slots for every expert
    L = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["lognormal", "small_ints", "zipf"]))
    if kind == "lognormal":
        w = rng.lognormal(0, 1.5, (L, E)) * 100
    elif kind == "small_ints":  # many ties
        w = rng.integers(0, 6, (L, E)).astype(np.float64)
    else:
        w = np.stack([rng.permutation(1000.0 / np.arange(1, E + 1)) for _ in range(L)])
    return w, P * S, G, N, P


@settings(max_examples=100, deadline=None)
@given(problems())
def test_valid_and_never_worse_than_reference(problem) -> None:
    w, R, G, N, P = problem
    out = rebalance_experts(torch.tensor(w), R, G, N, P)
    assert_valid(w, R, G, N, P, *out)
    ours = gpu_max_load(w, out[0].numpy(), P)
    ref = gpu_max_load(w, oracle_reference(w, R, G, N, P), P)
    assert (ours <= ref * (1 + 1e-9) + 1e-9).all()


def test_never_worse_and_mostly_better_on_realistic_sizes() -> None:
    rng = np.random.default_rng(0)
    better = total = 0
    for R, G, N, P in [(72, 4, 2, 8), (80, 4, 4, 16), (96, 1, 2, 16), (64, 8, 3, 32)]:
        w = rng.lognormal(0, 1, (4, 64)) * 1000
        ours = gpu_max_load(w, rebalance_experts(w, R, G, N, P)[0].numpy(), P)
        ref = gpu_max_load(w, oracle_reference(w, R, G, N, P), P)
        assert (ours <= ref * (1 + 1e-9)).all()
        better += int((ours < ref * (1 - 1e-9)).sum())
        total += len(w)
    assert better > total // 2


def test_avoids_two_replicas_on_one_gpu() -> None:
    rng = np.random.default_rng(1)
    w = rng.lognormal(0, 1, (6, 64)) * 1000
    R, G, N, P = 96, 1, 2, 16  # counts up to 16 replicas fit one per GPU
    phy2log = rebalance_experts(w, R, G, N, P)[0].numpy()
    per_gpu = np.sort(phy2log.reshape(6, P, -1), -1)
    assert not (per_gpu[..., 1:] == per_gpu[..., :-1]).any()
    # and it is still at least as balanced as the reference, which often doubles up
    assert (
        gpu_max_load(w, phy2log, P) <= gpu_max_load(w, oracle_reference(w, R, G, N, P), P) * (1 + 1e-9)
    ).all()


def test_allowing_duplicates_is_never_less_balanced() -> None:
    rng = np.random.default_rng(2)
    w = rng.lognormal(0, 1.5, (4, 32)) * 1000
    strict = gpu_max_load(w, rebalance_experts(w, 64, 4, 2, 8)[0].numpy(), 8)
    loose = gpu_max_load(w, rebalance_experts(w, 64, 4, 2, 8, avoid_duplicates=False)[0].numpy(), 8)
    assert (loose <= strict * (1 + 1e-9)).all()


def test_zero_load_layer() -> None:
    w = np.zeros((2, 16))
    out = rebalance_experts(w, 24, 4, 2, 8)
    assert_valid(w, 24, 4, 2, 8, *out)
    assert int(out[2].max()) <= 2  # with nothing to go on, redundant slots are spread, not piled on one


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float64])
def test_input_dtypes(dtype: torch.dtype) -> None:
    w = torch.tensor(README_WEIGHT).to(dtype)
    out = rebalance_experts(w, 16, 4, 2, 8)
    assert_valid(w.float().numpy(), 16, 4, 2, 8, *out)


def test_numpy_input_matches_torch_input() -> None:
    w = np.random.default_rng(3).lognormal(0, 1, (3, 32)) * 100
    a = rebalance_experts(w, 48, 4, 2, 8)
    b = rebalance_experts(torch.tensor(w), 48, 4, 2, 8)
    assert all((x == y).all() for x, y in zip(a, b, strict=True))


def test_slots_equal_experts_and_one_gpu() -> None:
    w = np.random.default_rng(4).lognormal(0, 1, (2, 8)) * 100
    for R, G, N, P in [(8, 4, 2, 8), (8, 2, 1, 1), (16, 1, 1, 1)]:
        assert_valid(w, R, G, N, P, *rebalance_experts(w, R, G, N, P))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_replicas=20), "multiple of num_gpus"),
        (dict(num_replicas=8), "fewer than the 12 logical experts"),
        (dict(num_groups=5, num_nodes=1), "equal groups"),
        (dict(num_gpus=6), "multiple of num_gpus"),
        (dict(num_gpus=12, num_replicas=24, num_nodes=5, num_groups=5), "multiple of num_nodes"),
        (dict(max_slots_per_gpu=1), "max_slots_per_gpu"),
    ],
)
def test_invalid_sizes_raise(kwargs: dict, message: str) -> None:
    args = dict(num_replicas=16, num_groups=4, num_nodes=2, num_gpus=8) | kwargs
    with pytest.raises(ValueError, match=message):
        rebalance_experts(torch.tensor(README_WEIGHT), **args)


def test_invalid_weight_raises() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        rebalance_experts(-torch.tensor(README_WEIGHT), 16, 4, 2, 8)
    with pytest.raises(ValueError, match="rebalance_experts_over_window"):
        rebalance_experts(torch.ones(3, 2, 12), 16, 4, 2, 8)


def test_window_objective_never_worse_than_reference_on_sum() -> None:
    rng = np.random.default_rng(5)
    T, L, E, R, G, N, P = 6, 3, 32, 48, 4, 2, 8
    base = rng.lognormal(0, 1, (L, E))
    w = np.stack([base * rng.lognormal(0, 0.8, (L, E)) for _ in range(T)]) * 100  # [T, L, E]

    def window_cost(phy2log: np.ndarray) -> np.ndarray:
        return sum(gpu_max_load(w[t], phy2log, P) for t in range(T))

    out = rebalance_experts_over_window(w, R, G, N, P)
    assert_valid(w.sum(0), R, G, N, P, *out)
    ours = window_cost(out[0].numpy())
    ref = window_cost(oracle_reference(w.sum(0), R, G, N, P))
    assert (ours <= ref * (1 + 1e-9)).all()
    assert ours.sum() < window_cost(rebalance_experts(w.sum(0), R, G, N, P)[0].numpy()).sum()
    with pytest.raises(ValueError, match="time_weights"):
        rebalance_experts_over_window(w, R, G, N, P, time_weights=[1.0])


def test_logical_to_physical_map_inverts() -> None:
    phy2log = torch.tensor([[2, 0, 2, 1, 0, 2]])
    log2phy, logcnt = logical_to_physical_map(phy2log, 4)
    assert logcnt.tolist() == [[2, 1, 3, 0]]
    assert log2phy.tolist() == [[[1, 4, -1], [3, -1, -1], [0, 2, 5], [-1, -1, -1]]]


def test_reference_policy_is_the_reference() -> None:
    """--eplb-algorithm deepseek runs the reference's placement itself: the README's, and the oracle's on random
    loads (float32 ties aside: integer loads with distinct per-replica values)."""
    from moeserve.eplb.algorithm import rebalance_experts_reference

    assert rebalance_experts_reference(torch.tensor(README_WEIGHT), 16, 4, 2, 8)[0].tolist() == README_PHY2LOG
    gen = torch.Generator().manual_seed(11)
    for R, G, N, P in [(16, 4, 2, 8), (24, 4, 2, 4), (20, 4, 1, 4), (32, 8, 4, 8)]:
        w = torch.randperm(2 * 16, generator=gen)[:16].view(1, 16).repeat(3, 1) * 7 + torch.arange(3)[:, None]
        phy2log, log2phy, logcnt = rebalance_experts_reference(w, R, G, N, P)
        assert_valid(w, R, G, N, P, phy2log, log2phy, logcnt)
        assert phy2log.tolist() == oracle_reference(w.numpy(), R, G, N, P).tolist(), (R, G, N, P)
