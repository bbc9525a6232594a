"""The online rebalancer's state machine on one process: the window, the plan, prepare, execute in chunks, and what
the other ranks' header codes make it do (wait, undo, commit). Weights and maps are checked exactly against the
placement they should hold."""

from __future__ import annotations

import time

import torch

from moeserve.eplb.algorithm import rebalance_experts_reference
from moeserve.eplb.location import ExpertLocation
from moeserve.eplb.rebalancer import FAILED, SKIPPED, WORKING, RebalanceOptions, Rebalancer

LAYERS, EXPERTS, EP, HIDDEN, INTER = 3, 8, 2, 4, 3


def _expert(layer: int, logical: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A recognisable (w13, w2) for each (layer, expert)."""
    g = torch.Generator().manual_seed(1000 * layer + logical)
    return torch.randn(2 * INTER, HIDDEN, generator=g), torch.randn(HIDDEN, INTER, generator=g)


class FakeLayer:
    """This rank's slots of one MoE layer, loaded with the experts `location` gives them."""

    def __init__(self, location: ExpertLocation, i: int, rank: int):
        per = location.num_local_physical_experts
        self.ids = location.physical_to_logical_map[i, rank * per:(rank + 1) * per].tolist()
        self.w13 = torch.stack([_expert(i, e)[0] for e in self.ids])
        self.w2 = torch.stack([_expert(i, e)[1] for e in self.ids])
        self.table = location.logical_to_rank_dispatch_physical_map[rank, i].clone()
        self.rank = rank

    def slot_weights(self):
        return self.w13, self.w2

    def set_placement(self, location: ExpertLocation, i: int) -> None:
        per = location.num_local_physical_experts
        self.ids = location.physical_to_logical_map[i, self.rank * per:(self.rank + 1) * per].tolist()
        self.table.copy_(location.logical_to_rank_dispatch_physical_map[self.rank, i])

    def holds(self, i: int) -> bool:
        """Every slot holds the weights of the expert its id says."""
        return all(torch.equal(self.w13[s], _expert(i, e)[0]) and torch.equal(self.w2[s], _expert(i, e)[1])
                   for s, e in enumerate(self.ids))


def _setup(**options):
    location = ExpertLocation.trivial(LAYERS, EXPERTS, EXPERTS, EP)
    layers = [FakeLayer(location, i, 0) for i in range(LAYERS)]
    counts = torch.zeros(LAYERS, EXPERTS, dtype=torch.int64)
    reb = Rebalancer(layers, location, _expert, counts, RebalanceOptions(interval=2, **options), ep_rank=0,
                     group=None, device=torch.device("cpu"))
    return reb, layers, location, counts


def _skew(counts: torch.Tensor) -> None:
    counts[:, :4] += torch.tensor([400, 300, 200, 100])  # experts 0-3, all on rank 0 in the trivial placement
    counts[:, 4:] += 10


def _wait_ready(reb: Rebalancer) -> int:
    for _ in range(500):
        if reb.status() != WORKING:
            return reb.status()
        time.sleep(0.01)
    raise AssertionError("prepare did not finish")


def _start(reb: Rebalancer, counts: torch.Tensor) -> None:
    _skew(counts)
    reb.begin_pass([WORKING], forward=True)  # pass 1
    reb.begin_pass([WORKING], forward=True)  # pass 2: the window is checked, planning starts


def test_rebalance_moves_hot_experts_apart_in_chunks():
    reb, layers, location, counts = _setup(layers_per_chunk=2)
    old = location.physical_to_logical_map.clone()
    _start(reb, counts)
    assert reb.report.balancedness < 0.6  # rank 0 holds all the hot experts
    assert _wait_ready(reb) == 1  # ready for chunk 0
    reb.begin_pass([1, WORKING], forward=True)  # the other rank is not ready: nothing happens
    assert all(layer.ids == old[i, :4].tolist() for i, layer in enumerate(layers))
    reb.begin_pass([1, 1], forward=True)  # chunk 0 = layers 0 and 1
    assert reb.status() == 2
    assert layers[2].ids == old[2, :4].tolist() and layers[0].ids != old[0, :4].tolist()
    assert all(layer.holds(i) for i, layer in enumerate(layers))  # weights follow the maps at every step
    reb.begin_pass([2, 2], forward=True)  # chunk 1 = layer 2
    assert reb.status() == 3  # every chunk executed
    assert torch.equal(location.physical_to_logical_map, old)  # committed only when every rank is done
    reb.begin_pass([3, 3], forward=False)
    assert reb.report.rebalances == 1 and reb.report.num_stalls == 2
    new = location.physical_to_logical_map
    assert not torch.equal(new, old)
    for i, layer in enumerate(layers):
        assert layer.holds(i)
        assert layer.ids == new[i, :4].tolist()
        assert torch.equal(layer.table, location.logical_to_rank_dispatch_physical_map[0, i])
        hot_on_rank0 = sum(e < 4 for e in new[i, :4].tolist())
        assert hot_on_rank0 == 2  # two hot experts per rank


def test_another_ranks_failure_undoes_executed_chunks():
    reb, layers, location, counts = _setup(layers_per_chunk=1)
    old = location.physical_to_logical_map.clone()
    tables = [layer.table.clone() for layer in layers]
    _start(reb, counts)
    assert _wait_ready(reb) == 1
    reb.begin_pass([1, 1], forward=True)
    reb.begin_pass([2, 2], forward=True)  # two of three chunks executed
    reb.begin_pass([3, FAILED], forward=True)  # the other rank fails its check of chunk 2
    assert reb.status() == WORKING and reb.report.rebalances == 0
    assert torch.equal(location.physical_to_logical_map, old)
    for i, layer in enumerate(layers):
        assert layer.ids == old[i, :4].tolist() and layer.holds(i) and torch.equal(layer.table, tables[i])


def test_own_failures_in_prepare_and_execute_are_reported():
    reb, layers, location, counts = _setup(fail=("prepare", 0))
    _start(reb, counts)
    assert _wait_ready(reb) == FAILED
    reb.begin_pass([FAILED, 1], forward=True)
    assert reb.status() == WORKING and all(layer.holds(i) for i, layer in enumerate(layers))

    reb, layers, location, counts = _setup(fail=("execute", 0), layers_per_chunk=2)
    old = location.physical_to_logical_map.clone()
    _start(reb, counts)
    assert _wait_ready(reb) == 1
    reb.begin_pass([1, 1], forward=True)
    assert reb.status() == FAILED  # the check of the last chunk fails, before anything of it is swapped
    reb.begin_pass([FAILED, 2], forward=True)
    assert torch.equal(location.physical_to_logical_map, old)
    assert all(layer.ids == old[i, :4].tolist() and layer.holds(i) for i, layer in enumerate(layers))


def test_balanced_windows_and_small_gains_are_skipped():
    reb, layers, location, counts = _setup()
    counts += 50  # uniform load: balancedness 1.0, at the default threshold
    reb.begin_pass([WORKING], forward=True)
    reb.begin_pass([WORKING], forward=True)
    assert reb.status() == WORKING and reb._job is None and reb.report.balancedness == 1.0

    reb, layers, location, counts = _setup(utilization_threshold=1.0, min_improvement=2.0)  # no plan gains 2.0
    _start(reb, counts)
    assert _wait_ready(reb) == SKIPPED
    reb.begin_pass([SKIPPED, WORKING], forward=True)  # waits for the other rank's verdict
    assert reb._job is not None
    reb.begin_pass([SKIPPED, SKIPPED], forward=True)
    assert reb._job is None and reb.report.rebalances == 0


def test_deepseek_policy_is_the_reference():
    reb, layers, location, counts = _setup(algorithm="deepseek")
    _start(reb, counts)
    assert _wait_ready(reb) == 1
    expected = rebalance_experts_reference(counts.double(), EXPERTS, 1, 1, EP)[0]
    assert torch.equal(reb._job.new.physical_to_logical_map, expected)


def test_rebalance_to_a_given_placement():
    """Unplanned (benchmarks): the given placement, its experts from the weight source, through the same phases."""
    reb, layers, location, counts = _setup(layers_per_chunk=3)
    g = torch.Generator().manual_seed(2)
    target = ExpertLocation.from_placement(torch.stack([torch.randperm(EXPERTS, generator=g) for _ in range(LAYERS)]),
                                           EP)
    reb.rebalance_to(target, from_host=True)
    assert _wait_ready(reb) == 1 and all(m.from_slot is None for m in reb._job.moves)
    reb.begin_pass([1, 1], forward=True)
    reb.begin_pass([2, 2], forward=True)
    assert torch.equal(location.physical_to_logical_map, target.physical_to_logical_map)
    assert all(layer.holds(i) for i, layer in enumerate(layers))
