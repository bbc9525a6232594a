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


# ---------------------------------------------------------------- FP8 slots and the staging cap (issue 47)
def _fp8_expert(layer: int, logical: int) -> tuple[torch.Tensor, ...]:
    """A recognisable (w13 e4m3, its block scales, w2 e4m3, its block scales) for each (layer, expert)."""
    w13, w2 = _expert(layer, logical)
    g = torch.Generator().manual_seed(7000 + 1000 * layer + logical)
    return (w13.to(torch.float8_e4m3fn), torch.rand(1, 1, generator=g), w2.to(torch.float8_e4m3fn),
            torch.rand(1, 1, generator=g))


class Fp8FakeLayer:
    """FakeLayer's slots in FP8, each expert's weights with their scales (four tensors per slot)."""

    def __init__(self, location: ExpertLocation, i: int, rank: int):
        self.base = FakeLayer(location, i, rank)
        self.slots = tuple(torch.stack([_fp8_expert(i, e)[k] for e in self.base.ids]) for k in range(4))

    def slot_weights(self):
        return self.slots

    def set_placement(self, location: ExpertLocation, i: int) -> None:
        self.base.set_placement(location, i)

    def holds(self, i: int) -> bool:
        return all(torch.equal(w[s].view(torch.uint8) if w.element_size() == 1 else w[s],
                               t.view(torch.uint8) if t.element_size() == 1 else t)
                   for s, e in enumerate(self.base.ids) for w, t in zip(self.slots, _fp8_expert(i, e), strict=True))


def _fp8_setup(cap: int):
    location = ExpertLocation.trivial(LAYERS, EXPERTS, EXPERTS, EP)
    layers = [Fp8FakeLayer(location, i, 0) for i in range(LAYERS)]
    counts = torch.zeros(LAYERS, EXPERTS, dtype=torch.int64)
    reb = Rebalancer(layers, location, _fp8_expert, counts,
                     RebalanceOptions(interval=2, layers_per_chunk=1, staging_max_bytes=cap), ep_rank=0, group=None,
                     device=torch.device("cpu"))
    return reb, layers, location, counts


def _staged(reb: Rebalancer) -> int:
    """The bytes of staging buffers the rebalancer holds, counted from the buffers themselves."""
    job = reb._job
    if job is None or job.pool is None:
        return 0
    for _, incoming, spare in job.staging.values():  # every buffer is a view of the pool
        for t in (*incoming, *spare):
            assert t.untyped_storage().data_ptr() == job.pool.untyped_storage().data_ptr()
    return job.pool.nbytes


CAP = 3000  # a layer stages 2 (incoming, spare) x 4 tensors x 256 bytes (aligned): one layer a round


def test_fp8_slots_move_with_their_scales_in_rounds_under_the_cap():
    reb, layers, location, counts = _fp8_setup(CAP)
    old = location.physical_to_logical_map.clone()
    _start(reb, counts)
    rounds, passes = set(), 0
    while reb._job is not None and passes < 50:
        code = _wait_ready(reb)
        assert code > 0, reb._job.error
        assert _staged(reb) == reb.staged_bytes <= CAP and reb.report.peak_staged_bytes <= CAP
        rounds.add(reb._job.round)
        assert all(layer.holds(i) for i, layer in enumerate(layers))  # weights and scales follow the maps
        reb.begin_pass([code, code], forward=True)
        passes += 1
    assert len(rounds) >= 2 and reb.report.rebalances == 1  # the plan did not fit the cap at once
    assert not torch.equal(location.physical_to_logical_map, old)
    assert all(layer.holds(i) and layer.base.ids == location.physical_to_logical_map[i, :4].tolist()
               for i, layer in enumerate(layers))


def test_fp8_failure_in_a_later_round_restores_every_layer():
    reb, layers, location, counts = _fp8_setup(CAP)
    old = location.physical_to_logical_map.clone()
    tables = [layer.base.table.clone() for layer in layers]
    _start(reb, counts)
    while reb._job is not None:
        code = _wait_ready(reb)
        last = code == len(reb._job.chunks)  # the last chunk: the other rank's check fails
        assert not last or reb._job.round >= 1
        reb.begin_pass([code, FAILED if last else code], forward=True)
    assert reb.report.rebalances == 0 and reb.staged_bytes == 0
    assert torch.equal(location.physical_to_logical_map, old)
    for i, layer in enumerate(layers):
        assert layer.base.ids == old[i, :4].tolist() and layer.holds(i) and torch.equal(layer.base.table, tables[i])


def test_a_cap_below_one_layer_fails_the_rebalance():
    reb, layers, location, counts = _fp8_setup(1024)
    _start(reb, counts)
    assert _wait_ready(reb) == FAILED and "--eplb-staging-max-mb" in reb._job.error
    reb.begin_pass([FAILED, FAILED], forward=True)
    assert reb._job is None and all(layer.holds(i) for i, layer in enumerate(layers))


class PackedLayer:
    """This rank's slots of one MoE layer held by a real Experts module: packed for the CPU kernels where they run
    (bf16, the amx and avx512bf16 builds), its expert_slot the rebalancer's weight source."""

    H, INTER = 64, 32  # packable sizes

    def __init__(self, location: ExpertLocation, i: int, rank: int):
        from moeserve.layers.moe.experts import Experts

        per = location.num_local_physical_experts
        self.i, self.rank = i, rank
        self.ids = location.physical_to_logical_map[i, rank * per:(rank + 1) * per].tolist()
        self.experts = Experts(self.H, self.INTER, EXPERTS, self.ids).to(torch.bfloat16)
        with torch.no_grad():
            for s, e in enumerate(self.ids):
                self.experts.w13[s], self.experts.w2[s] = self.expert(e)
        self.experts.process_weights_after_loading(torch.device("cpu"))

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * self.i + e)
        return (torch.randn(2 * self.INTER, self.H, generator=g).bfloat16(),
                torch.randn(self.H, self.INTER, generator=g).bfloat16())

    def source(self, e: int) -> tuple[torch.Tensor, ...]:
        w13, w2 = self.expert(e)
        keys = {"gate": w13[:self.INTER], "up": w13[self.INTER:], "down": w2}
        return self.experts.expert_slot(keys.__getitem__, ("gate", "up", "down"))

    def slot_weights(self):
        return self.experts.w13.data, self.experts.w2.data

    def set_placement(self, location: ExpertLocation, i: int) -> None:
        per = location.num_local_physical_experts
        self.ids = location.physical_to_logical_map[i, self.rank * per:(self.rank + 1) * per].tolist()
        self.experts.slots_changed()

    def holds(self) -> bool:
        w13, w2 = self.experts.logical_weights()
        return all(torch.equal(w13[s], self.expert(e)[0]) and torch.equal(w2[s], self.expert(e)[1])
                   for s, e in enumerate(self.ids))


def test_packed_experts_move_and_come_back():
    """Packed slots (where the CPU runs them) are moved by a rebalance and restored by an undo exactly: after
    every step each slot holds, unpacked, the expert its id names."""
    from moeserve.kernels import cpu_experts

    location = ExpertLocation.trivial(LAYERS, EXPERTS, EXPERTS, EP)
    layers = [PackedLayer(location, i, 0) for i in range(LAYERS)]
    assert all(layer.experts.packed == cpu_experts.packed_runs() for layer in layers)
    counts = torch.zeros(LAYERS, EXPERTS, dtype=torch.int64)
    reb = Rebalancer(layers, location, lambda i, e: layers[i].source(e), counts,
                     RebalanceOptions(interval=2, layers_per_chunk=1), ep_rank=0, group=None,
                     device=torch.device("cpu"))
    old = location.physical_to_logical_map.clone()
    _start(reb, counts)
    assert _wait_ready(reb) == 1
    reb.begin_pass([1, 1], forward=True)  # chunk 0 = layer 0
    assert layers[0].ids != old[0, :4].tolist() and all(layer.holds() for layer in layers)
    reb.begin_pass([2, FAILED], forward=True)  # the other rank fails: layer 0 undone
    assert all(layer.ids == old[i, :4].tolist() and layer.holds() for i, layer in enumerate(layers))
    _start(reb, counts)  # and again, to the end
    assert _wait_ready(reb) == 1
    for c in range(1, LAYERS + 1):
        reb.begin_pass([c, c], forward=True)
    reb.begin_pass([LAYERS + 1] * 2, forward=False)
    assert reb.report.rebalances == 1 and not torch.equal(location.physical_to_logical_map, old)
    assert all(layer.ids == location.physical_to_logical_map[i, :4].tolist() and layer.holds()
               for i, layer in enumerate(layers))
