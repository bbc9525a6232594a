"""ExpertLocation: consistent maps, dispatch preferences and fairness, files, in-place updates."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moeserve.eplb.algorithm import rebalance_experts
from moeserve.eplb.location import ExpertLocation


def random_location(
    seed: int = 0, L: int = 3, E: int = 32, R: int = 48, ep: int = 8, gpn: int = 4
) -> ExpertLocation:
    weight = np.random.default_rng(seed).lognormal(0, 1.2, (L, E)) * 100
    return ExpertLocation.from_logical_count(weight, R, ep, ep // gpn, 4)


def assert_consistent(loc: ExpertLocation) -> None:
    p2l = loc.physical_to_logical_map
    L, R = p2l.shape
    E = loc.num_logical_experts
    all_phys, num_valid = loc.logical_to_all_physical_map, loc.logical_to_all_physical_map_num_valid
    assert all_phys.shape == (L, E, R - E + 1)
    assert (num_valid >= 1).all() and (num_valid.sum(1) == R).all()
    for layer in range(L):
        for e in range(E):
            c = int(num_valid[layer, e])
            assert (p2l[layer, all_phys[layer, e, :c]] == e).all() and (all_phys[layer, e, c:] == -1).all()
    dispatch = loc.logical_to_rank_dispatch_physical_map
    assert dispatch.shape == (loc.ep_size, L, E)
    assert (torch.gather(p2l.expand(loc.ep_size, -1, -1), 2, dispatch) == torch.arange(E)).all()


def test_trivial() -> None:
    loc = ExpertLocation.trivial(2, 8, 16, 4)
    assert_consistent(loc)
    assert loc.physical_to_logical_map[0].tolist() == list(range(8)) * 2
    assert loc.num_local_physical_experts == 4


def test_from_placement_maps_are_consistent() -> None:
    loc = random_location()
    assert_consistent(loc)
    assert (loc.num_nodes, loc.num_gpus_per_node) == (2, 4)


def test_static_dispatch_prefers_own_gpu_then_node() -> None:
    loc = random_location(seed=1)
    p2l, dispatch = loc.physical_to_logical_map, loc.logical_to_rank_dispatch_physical_map
    S, gpn = loc.num_local_physical_experts, loc.num_gpus_per_node
    gpu_of_slot = torch.arange(loc.num_physical_experts) // S
    for rank in range(loc.ep_size):
        for layer in range(loc.num_layers):
            own = set(p2l[layer, rank * S : (rank + 1) * S].tolist())
            node = rank // gpn
            node_experts = set(p2l[layer, node * gpn * S : (node + 1) * gpn * S].tolist())
            for e in range(loc.num_logical_experts):
                target_gpu = int(gpu_of_slot[dispatch[rank, layer, e]])
                if e in own:
                    assert target_gpu == rank
                elif e in node_experts:
                    assert target_gpu // gpn == node


def test_static_dispatch_spreads_ranks_evenly() -> None:
    # one GPU per node: every rank that does not hold an expert is "remote", so shares can be exact
    loc = random_location(seed=2, ep=8, gpn=1)
    dispatch = loc.logical_to_rank_dispatch_physical_map  # [ep, L, E]
    for layer in range(loc.num_layers):
        for e in range(loc.num_logical_experts):
            slots = loc.logical_to_all_physical_map[
                layer, e, : loc.logical_to_all_physical_map_num_valid[layer, e]
            ]
            share = [(dispatch[:, layer, e] == s).sum().item() for s in slots.tolist()]
            assert sum(share) == loc.ep_size and max(share) - min(share) <= 1


def test_static_dispatch_fair_across_nodes() -> None:
    # an expert with two replicas on node 0 and one on node 1 (4 nodes of 2 GPUs)
    p2l = torch.tensor([[0, 1, 0, 2, 0, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6]])  # 8 GPUs x 2 slots
    loc = ExpertLocation.from_placement(p2l, 8, 2, num_logical_experts=8)
    share = [(loc.logical_to_rank_dispatch_physical_map[:, 0, 0] == s).sum().item() for s in (0, 2, 4)]
    assert sum(share) == 8 and max(share) - min(share) <= 1


def test_select_physical_static_and_all_layers() -> None:
    loc = random_location(seed=3)
    ids = torch.randint(0, loc.num_logical_experts, (50, 4), generator=torch.Generator().manual_seed(0))
    one = loc.select_physical(ids, 1, rank=5)
    assert one.dtype == torch.int64 and one.shape == ids.shape
    assert (loc.physical_to_logical_map[1][one] == ids).all()
    all_layers = loc.select_physical(ids.expand(loc.num_layers, -1, -1), None, rank=5)
    assert (all_layers[1] == one).all()


def test_select_physical_dynamic_spreads_tokens() -> None:
    loc = random_location(seed=4)
    p2l = loc.physical_to_logical_map
    num_valid = loc.logical_to_all_physical_map_num_valid
    layer, e = divmod(int(num_valid.argmax()), loc.num_logical_experts)  # the expert with the most replicas
    c = int(num_valid[layer, e])
    ids = torch.full((6000, 1), e)
    for generator in (torch.Generator().manual_seed(7), None):
        phys = loc.select_physical(ids, layer, rank=0, mode="dynamic", generator=generator)
        assert (p2l[layer][phys] == e).all()
        share = torch.bincount(phys.flatten(), minlength=loc.num_physical_experts)
        share = share[loc.logical_to_all_physical_map[layer, e, :c]]
        assert share.sum() == 6000 and (share > 0.85 * 6000 / c).all()
    a = loc.select_physical(ids, layer, 0, "dynamic", torch.Generator().manual_seed(1))
    b = loc.select_physical(ids, layer, 0, "dynamic", torch.Generator().manual_seed(1))
    assert (a == b).all()
    with pytest.raises(ValueError, match="mode"):
        loc.select_physical(ids, layer, 0, mode="fake")


@pytest.mark.parametrize("suffix", [".pt", ".json"])
def test_save_load_round_trip(tmp_path, suffix: str) -> None:
    loc = random_location(seed=5)
    path = loc.save(tmp_path / f"loc{suffix}")
    back = ExpertLocation.load(path, ep_size=8, num_gpus_per_node=4)
    for name in (
        "physical_to_logical_map",
        "logical_to_all_physical_map",
        "logical_to_rank_dispatch_physical_map",
    ):
        assert torch.equal(getattr(back, name), getattr(loc, name))
    with pytest.raises(ValueError, match="logical experts"):
        ExpertLocation.load(path, ep_size=8, num_gpus_per_node=4, num_logical_experts=64)


@pytest.mark.parametrize("shape", [(5, 3, 32), (3, 32)])
def test_load_recorder_dump(tmp_path, shape: tuple[int, ...]) -> None:
    counts = torch.randint(0, 1000, shape, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "expert_distribution_recorder_1700000000.pt"
    torch.save({"rank": 0, "logical_count": counts, "average_utilization_rate_over_window": 0.5}, path)
    loc = ExpertLocation.load(path, ep_size=8, num_gpus_per_node=4, num_physical_experts=48, num_groups=4)
    summed = counts.sum(0) if counts.ndim == 3 else counts
    expected = rebalance_experts(summed, 48, 4, 2, 8)[0]
    assert torch.equal(loc.physical_to_logical_map, expected)
    with pytest.raises(ValueError, match="num_physical_experts"):
        ExpertLocation.load(path, ep_size=8, num_gpus_per_node=4)


def test_load_json_logical_count_and_bad_files(tmp_path) -> None:
    path = tmp_path / "counts.json"
    path.write_text(json.dumps({"logical_count": np.random.default_rng(0).integers(0, 9, (2, 16)).tolist()}))
    assert_consistent(ExpertLocation.load(path, ep_size=4, num_physical_experts=16))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"something": 1}))
    with pytest.raises(ValueError, match="neither"):
        ExpertLocation.load(bad, ep_size=4)
    with pytest.raises(ValueError, match="does not exist"):
        ExpertLocation.load(tmp_path / "missing.pt", ep_size=4)


def test_update_in_place_keeps_tensors() -> None:
    loc = random_location(seed=6)
    before = {name: getattr(loc, name).data_ptr() for name in vars(loc) if name.endswith(("_map", "_valid"))}
    other = random_location(seed=7)
    loc.update_(other)
    for name, ptr in before.items():
        assert getattr(loc, name).data_ptr() == ptr
        assert torch.equal(getattr(loc, name), getattr(other, name))
    with pytest.raises(ValueError, match="shape"):
        loc.update_(random_location(seed=8, R=64))


def test_to_device_copies() -> None:
    loc = random_location(seed=9)
    moved = loc.to("cpu")
    assert moved is not loc and torch.equal(moved.physical_to_logical_map, loc.physical_to_logical_map)


@pytest.mark.parametrize(
    "phy2log, ep, kwargs, message",
    [
        ([[0, 1, 2, 3, 0, 1]], 4, {}, "multiple of ep_size"),
        ([[0, 1, 2, 3]], 2, dict(num_logical_experts=6), "fewer than"),
        ([[0, 1, 1, 3]], 2, dict(num_logical_experts=4), "no replica"),
        ([[0, 1, 2, 3]], 4, dict(num_gpus_per_node=3), "num_gpus_per_node"),
        ([[0.0, 1.0]], 2, {}, "integer"),
        ([[0, 1, 2, 9]], 2, dict(num_logical_experts=4), "outside"),
    ],
)
def test_invalid_placements_raise(phy2log, ep: int, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ExpertLocation.from_placement(torch.tensor(phy2log), ep, **kwargs)
