"""Online EPLB: the expert placement rebalanced while serving, in three phases, on every rank in lock-step.

Every `interval` forward passes (one lock-step forward of all ranks; every rank counts the same passes):

1. window (the one synchronous step, a collective of a few KB): the ranks sum the tokens routed since the last
   check, per logical expert, and per physical slot they were sent to. Balancedness under the placement in force
   (mean / max routed tokens per GPU, averaged over MoE layers) is measured; at or above the threshold nothing
   else happens.
2. plan and prepare, in a background thread while serving goes on: the placement for the window (moeserve's
   algorithm, or DeepSeek's reference policy; expert groups and nodes respected), dropped unless it raises the
   window's balancedness by a margin; then this rank's incoming experts are copied into staging buffers: from a
   slot of this rank that already holds the expert (device to device), else from the expert weight source (host
   memory, the memory-mapped checkpoint, or the dummy generator); on CUDA on a side stream.
3. execute, between forward passes, a chunk of MoE layers per pass: each rank swaps its changed slots with the
   staging buffers and updates the layers' maps in place. No buffer is reallocated, so CUDA graphs stay valid.

Agreement: each rank reports its state in the lock-step header (`status`), and `begin_pass` acts only on what
every rank reported (the same list on every rank), so all ranks execute a chunk at the same pass. A chunk runs
only once every rank has checked that it can. If any rank fails (memory, a read error, a check), every rank swaps
back what it executed (a swap leaves the old weights in the staging buffers) and keeps the old placement.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from moeserve.core.background_thread import background_thread
from moeserve.eplb.algorithm import rebalance_experts, rebalance_experts_reference
from moeserve.eplb.location import ExpertLocation
from moeserve.eplb.metrics import balancedness_of_loads, gpu_loads

logger = logging.getLogger(__name__)

# torch 2.13 deprecates all_gather_into_tensor for all_gather_single; older torch has only the former.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Header codes (`status`): 1 + c means ready to execute chunk c; 1 + num_chunks means every chunk is executed.
WORKING = 0  # nothing in flight, or still preparing
FAILED = -1
SKIPPED = -2  # the plan does not raise balancedness enough
ALGORITHMS = {"auto": rebalance_experts, "deepseek": rebalance_experts_reference}  # --eplb-algorithm
# An expert's per-slot tensors of `logical` expert in the `moe_index`-th MoE layer, in the order of the layer's
# slot_weights(): (w13 [2I, H], w2 [H, I]), or for FP8 experts (w13, w13_scale_inv, w2, w2_scale_inv).
ExpertSource = Callable[[int, int], tuple[torch.Tensor, ...]]
WEIGHT_SOURCES = ("memory", "mmap")  # --eplb-expert-weights: models/expert_weights.py reads each


class RebalancedLayer(Protocol):
    """One MoE layer as the rebalancer sees it: this rank's expert slots and the maps to update."""

    def slot_weights(self) -> tuple[torch.Tensor, ...]:
        """This rank's slots' tensors, each [E_local, ...]: (w13, w2), or FP8's weights with their block scales;
        they move together."""

    def set_placement(self, location: ExpertLocation, moe_index: int) -> None:
        """Copy this layer's row of `location` into its maps, in place (after its slots changed)."""


@dataclass(frozen=True)
class RebalanceOptions:
    """--enable-eplb and the flags around it."""

    interval: int  # --eplb-rebalance-num-iterations: forward passes between checks
    layers_per_chunk: int | None = None  # --eplb-rebalance-layers-per-chunk: None executes all at once
    utilization_threshold: float = 1.0  # --eplb-min-rebalancing-utilization-threshold
    min_improvement: float = 0.01  # --eplb-min-improvement
    algorithm: str = "auto"  # --eplb-algorithm
    dynamic_dispatch: bool = False  # --ep-dispatch-algorithm dynamic: tokens spread over all replicas
    num_groups: int = 1  # the model's expert groups
    fail: tuple[str, int] | None = None  # --eplb-debug-fail PHASE:RANK, for tests
    staging_max_bytes: int | None = None  # --eplb-staging-max-mb: None stages every layer at once


@dataclass
class Move:
    """One slot of this rank that gets another expert."""

    moe_index: int
    slot: int  # local slot
    logical: int  # the expert it gets
    from_slot: int | None  # a local slot that holds that expert in the old placement (a device copy)


@dataclass
class RebalanceReport:
    """What rank 0 tells the server with its load, for /metrics: cumulative, so no report can be missed."""

    rebalances: int = 0  # rebalances completed
    balancedness: float | None = None  # measured over the last window, under the placement in force
    num_stalls: int = 0  # execute stalls so far (one per chunk executed)
    stalls_s: list[float] = field(default_factory=list)  # the newest of them, at most MAX_KEPT
    # the newest windows, at most MAX_KEPT: (forward passes so far, balancedness, routed tokens per pass of the
    # busiest GPU, averaged over MoE layers)
    windows: list[tuple[int, float, float]] = field(default_factory=list)
    passes: int = 0  # forward passes so far
    staging_max_bytes: int | None = None  # the cap on staged bytes (--eplb-staging-max-mb)
    peak_staged_bytes: int = 0  # the most bytes a rebalance held in staging buffers at once, so far


MAX_KEPT = 4096
STAGING_FREE_SHARE = 0.05  # --eplb-staging-max-mb's default on CUDA: this share of free device memory
STAGING_CPU_DEFAULT = 256 << 20  # and on the CPU
UPLOAD_BATCH_BYTES = 16 << 20


@dataclass
class _Rebalance:
    """One rebalance in flight."""

    new: ExpertLocation
    moves: list[Move]
    chunks: list[range]  # moe indices of each chunk
    before: float  # measured balancedness of the window
    predicted: float  # the plan's balancedness on the window
    started: float = field(default_factory=time.perf_counter)
    # moe index -> (slots, incoming, spare): see Rebalancer._prepare
    staging: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = field(
        default_factory=dict)
    result: int = WORKING  # the prepare thread's outcome: 1 (ready), FAILED or SKIPPED
    error: str = ""
    executed: int = 0  # chunks executed
    plan_s: float = 0.0
    prepare_s: float = 0.0
    stalls: list[float] = field(default_factory=list)
    from_host: bool = False  # rebalance_to(from_host=True): no device copies from this rank's own slots
    rounds: list[range] = field(default_factory=list)  # chunk indices staged together (under the staging cap)
    round: int = 0  # the round staged now
    pool: torch.Tensor | None = None  # the staging bytes every round's buffers are views of
    # moe index -> (slots, the old experts on the host): layers of finished rounds, for an abort
    undo: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = field(default_factory=dict)


class Rebalancer:
    """Online EPLB on one rank (see the module doc)."""

    def __init__(self, layers: Sequence[RebalancedLayer], location: ExpertLocation, source: ExpertSource,
                 counts: torch.Tensor, options: RebalanceOptions, ep_rank: int, group: dist.ProcessGroup | None,
                 device: torch.device):
        """layers: the MoE layers in location's layer order; counts: the recorder's cumulative logical counts
        [layers, experts] on the device; group: a CPU (gloo) group over all ranks, None for one rank."""
        self.layers, self.location, self.source = list(layers), location, source
        self.counts, self.options, self.group, self.device = counts, options, group, device
        self.ep_rank, self.ep_size = ep_rank, location.ep_size
        self.passes = 0  # forward passes seen
        self._last_counts = counts.detach().to("cpu", copy=True)
        self._job: _Rebalance | None = None
        self._thread: threading.Thread | None = None
        self.report = RebalanceReport(staging_max_bytes=options.staging_max_bytes)
        self.staged_bytes = 0  # bytes of staging buffers held now (job.pool)
        # the stream the forward passes run on (this thread's): spare buffers come from its pool, swaps wait on it
        self._serving_stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    # ------------------------------------------------------------------ the lock-step interface
    def status(self) -> int:
        """This rank's code for the next header (see the header codes above)."""
        job = self._job
        if job is None or (self._thread is not None and self._thread.is_alive()) or job.result == WORKING:
            return WORKING
        if job.result != 1:
            return job.result
        if job.executed == len(job.chunks):
            return 1 + len(job.chunks)
        if self._injected("execute") and job.executed == len(job.chunks) - 1:
            job.error = "injected fault (--eplb-debug-fail execute)"
            return FAILED
        return 1 + job.executed

    def begin_pass(self, codes: Sequence[int], forward: bool) -> None:
        """Before a step, with every rank's status code; `forward`: the step runs a forward pass."""
        if self._job is not None:
            self._advance(codes)
        elif forward:
            self.passes += 1
            if self.passes % self.options.interval == 0:
                self._check_window()

    def snapshot(self) -> RebalanceReport:
        """A copy of the report (cumulative)."""
        r = self.report
        return RebalanceReport(r.rebalances, r.balancedness, r.num_stalls, list(r.stalls_s), list(r.windows),
                               self.passes, r.staging_max_bytes, r.peak_staged_bytes)

    # ------------------------------------------------------------------ 1. window
    def _check_window(self) -> None:
        per_rank = self._window()
        loads = self._gpu_loads(per_rank, self.location)
        before = float(balancedness_of_loads(loads).mean())
        busiest = float(loads.amax(-1).mean()) / self.options.interval
        self.report.balancedness = before
        self.report.windows = [*self.report.windows[-(MAX_KEPT - 1):], (self.passes, before, busiest)]
        if before >= self.options.utilization_threshold:
            self._log("EPLB: balancedness %.3f over the last %d passes is at least %.3f: no rebalance", before,
                      self.options.interval, self.options.utilization_threshold)
            return
        self._run(_Rebalance(self.location, [], [], before, before), self._plan_and_prepare, per_rank)

    def rebalance_to(self, location: ExpertLocation, from_host: bool = False) -> None:
        """Start a rebalance to `location` now, unplanned (benchmarks; every rank must call it at the same pass):
        prepare in the background, then execute and commit through begin_pass like a planned one. from_host:
        every incoming expert comes from the weight source, also those this rank holds already."""
        if self._job is not None:
            raise RuntimeError("a rebalance is in flight")
        job = _Rebalance(location, [], [], self.report.balancedness or 0.0, 0.0, from_host=from_host)
        self._run(job, self._prepare_job)

    def _run(self, job: _Rebalance, target: Callable[..., None], *args: object) -> None:
        """Phase 2 in a background thread that fills `job` in; whatever goes wrong there ends in FAILED."""
        def body() -> None:
            try:
                target(*args)
            except BaseException as e:  # noqa: BLE001 - never leave the ranks waiting for this one
                job.error, job.result, job.staging = f"{type(e).__name__}: {e}", FAILED, {}

        self._job = job
        self._thread = background_thread(body, "moeserve-eplb")
        self._thread.start()

    def _window(self) -> torch.Tensor:
        """[ranks, L, E] int64: the logical-expert token counts each rank routed since the last check."""
        now = self.counts.detach().to("cpu", copy=True)
        mine, self._last_counts = now - self._last_counts, now
        if self.group is None:
            return mine[None]
        out = torch.zeros(dist.get_world_size(self.group) * mine.numel(), dtype=mine.dtype)
        _all_gather(out, mine.reshape(-1), group=self.group)
        return out.view(-1, *mine.shape)

    def _gpu_loads(self, per_rank: torch.Tensor, location: ExpertLocation) -> torch.Tensor:
        """[L, GPUs] routed tokens, had `per_rank` [ranks, L, E] been routed with `location`: static dispatch sends
        rank r's tokens of expert e to its table's slot; dynamic spreads them over the replicas alike."""
        if self.options.dynamic_dispatch:
            return gpu_loads(per_rank.sum(0), location.physical_to_logical_map,
                             location.logical_to_all_physical_map_num_valid, self.ep_size)
        physical = torch.zeros(location.num_layers, location.num_physical_experts, dtype=torch.int64)
        tables = location.logical_to_rank_dispatch_physical_map  # [ep_size, L, E]
        for rank, counts in enumerate(per_rank):
            physical.scatter_add_(1, tables[rank % self.ep_size], counts)
        return physical.view(location.num_layers, self.ep_size, -1).sum(-1).double()

    def _balancedness(self, per_rank: torch.Tensor, location: ExpertLocation) -> float:
        """Mean over MoE layers of mean / max routed tokens per GPU (see _gpu_loads)."""
        return float(balancedness_of_loads(self._gpu_loads(per_rank, location)).mean())

    def _log(self, msg: str, *args: object, warning: bool = False) -> None:
        if self.ep_rank == 0:  # the ranks agree on everything logged here: one line for the server
            (logger.warning if warning else logger.info)(msg, *args)

    # ------------------------------------------------------------------ 2. plan and prepare (background thread)
    def _plan_and_prepare(self, per_rank: torch.Tensor) -> None:
        job = self._job
        before = job.before
        try:
            job.new = self._plan(per_rank.sum(0).double())
            job.predicted = self._balancedness(per_rank, job.new)
            job.plan_s = time.perf_counter() - job.started
            if job.predicted < before + self.options.min_improvement:
                job.error = (f"the plan's balancedness on the window, {job.predicted:.3f}, is within "
                             f"{self.options.min_improvement} of the placement in force ({before:.3f})")
                job.result = SKIPPED
                return
        except Exception as e:  # noqa: BLE001 - any failure keeps the old placement; the log says why
            job.error, job.result = f"{type(e).__name__}: {e}", FAILED
            return
        self._prepare_job()

    def _prepare_job(self) -> None:
        """Phase 2's second half, for job.new: this rank's moves, the chunks, the staging buffers."""
        job = self._job
        try:
            job.moves = self._moves(job.new, job.from_host)
            job.chunks, job.rounds = self._chunks_and_rounds(job.new)
            need = max(self._round_bytes(job, r) for r in range(len(job.rounds)))
            self.staged_bytes = need
            self.report.peak_staged_bytes = max(self.report.peak_staged_bytes, need)
            with torch.cuda.stream(self._serving_stream) if self.device.type == "cuda" else contextlib.nullcontext():
                job.pool = torch.empty(need, dtype=torch.uint8, device=self.device)  # the swaps allocate nothing
            t0 = time.perf_counter()
            self._prepare(job)
            job.prepare_s = time.perf_counter() - t0
            job.result = 1
        except Exception as e:  # noqa: BLE001 - any failure keeps the old placement; the log says why
            job.error, job.result, job.staging = f"{type(e).__name__}: {e}", FAILED, {}

    def _plan(self, logical: torch.Tensor) -> ExpertLocation:
        loc = self.location
        phy2log, _, _ = ALGORITHMS[self.options.algorithm](logical, loc.num_physical_experts, self.options.num_groups, loc.num_nodes,
                               self.ep_size)
        return ExpertLocation.from_placement(phy2log, self.ep_size, loc.num_gpus_per_node,
                                             num_logical_experts=loc.num_logical_experts)

    def _moves(self, new: ExpertLocation, from_host: bool = False) -> list[Move]:
        per_rank = self.location.num_local_physical_experts
        first = self.ep_rank * per_rank
        old_p2l = self.location.physical_to_logical_map[:, first:first + per_rank].tolist()
        new_p2l = new.physical_to_logical_map[:, first:first + per_rank].tolist()
        moves = []
        for i, (old_row, new_row) in enumerate(zip(old_p2l, new_p2l, strict=True)):
            for slot, (was, now) in enumerate(zip(old_row, new_row, strict=True)):
                if was != now:
                    local = old_row.index(now) if now in old_row and not from_host else None
                    moves.append(Move(i, slot, now, local))
        return moves

    def _chunks_and_rounds(self, new: ExpertLocation) -> tuple[list[range], list[range]]:
        """The execute chunks (--eplb-rebalance-layers-per-chunk, cut where a chunk would stage more than the
        cap) and the rounds: consecutive chunks that stage at most the cap together. Every rank plans the same
        ones (lock-step), from the rank that moves the most experts in each layer."""
        cap, num_layers = self.options.staging_max_bytes, self.location.num_layers
        changed = self.location.physical_to_logical_map != new.physical_to_logical_map
        per_layer = changed.view(num_layers, self.ep_size, -1).sum(-1).amax(-1).tolist()
        need = [self._layer_bytes(i, n) for i, n in enumerate(per_layer)]
        if cap is not None and max(need) > cap:
            raise RuntimeError(f"one MoE layer's moves stage {max(need) / 2**20:.1f} MiB, over --eplb-staging-max-mb "
                               f"({cap / 2**20:.1f} MiB)")
        n = self.options.layers_per_chunk or num_layers
        chunks: list[range] = []
        for i in range(num_layers):
            if chunks and len(chunks[-1]) < n and (cap is None or sum(need[j] for j in chunks[-1]) + need[i] <= cap):
                chunks[-1] = range(chunks[-1].start, i + 1)
            else:
                chunks.append(range(i, i + 1))
        rounds: list[range] = []
        for c, chunk in enumerate(chunks):
            total = sum(need[i] for r in rounds[-1:] for k in r for i in chunks[k]) + sum(need[i] for i in chunk)
            if rounds and (cap is None or total <= cap):
                rounds[-1] = range(rounds[-1].start, c + 1)
            else:
                rounds.append(range(c, c + 1))
        return chunks, rounds

    def _layer_bytes(self, i: int, num_moves: int) -> int:
        """Staging bytes of `num_moves` moves in layer i: incoming and spare buffers, each tensor aligned."""
        return 2 * sum(_aligned(num_moves * w[0].nbytes) for w in self.layers[i].slot_weights()) if num_moves else 0

    def _round_bytes(self, job: _Rebalance, r: int) -> int:
        per_layer: dict[int, int] = {}
        for m in job.moves:
            per_layer[m.moe_index] = per_layer.get(m.moe_index, 0) + 1
        return sum(self._layer_bytes(i, per_layer.get(i, 0)) for c in job.rounds[r] for i in job.chunks[c])

    def _prepare(self, job: _Rebalance) -> None:
        """Fill job.staging per MoE layer: its changed slots, their new experts stacked, and a spare buffer of the
        same size (a swap leaves the old experts there), on the side stream; every copy is done when this returns.

        The uploads go in batches of UPLOAD_BATCH_BYTES, each waited for before the next (16 MiB: about 0.4 ms of PCIe): the serving stream's own
        small host-to-device copies share the copy engine and must not queue behind gigabytes. The spare buffers
        come from the serving stream's pool, so the swaps allocate nothing."""
        if self._injected("prepare"):
            raise RuntimeError("injected fault (--eplb-debug-fail prepare)")
        cuda = self.device.type == "cuda"
        side = torch.cuda.Stream(self.device) if cuda else None
        layers = {i for c in job.rounds[job.round] for i in job.chunks[c]}
        by_layer: dict[int, list[Move]] = {}
        for m in job.moves:
            if m.moe_index in layers:
                by_layer.setdefault(m.moe_index, []).append(m)
        carve = _Carver(job.pool)
        in_flight = 0
        with torch.no_grad():
            for i, moves in by_layer.items():
                weights = self.layers[i].slot_weights()
                spare = tuple(carve(w, len(moves)) for w in weights)
                staged = tuple(carve(w, len(moves)) for w in weights)
                with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
                    for j, m in enumerate(moves):
                        src = (tuple(w[m.from_slot] for w in weights) if m.from_slot is not None
                               else self.source(i, m.logical))
                        if len(src) != len(staged):
                            raise ValueError(f"the expert weight source gives {len(src)} tensors per expert, the "
                                             f"layer's slots hold {len(staged)}")
                        for dst, t in zip(staged, src, strict=True):
                            dst[j].copy_(t, non_blocking=True)
                            in_flight += dst[j].nbytes
                        if cuda and in_flight >= UPLOAD_BATCH_BYTES:
                            side.synchronize()
                            in_flight = 0
                    slots = torch.tensor([m.slot for m in moves], dtype=torch.int64).to(self.device)
                job.staging[i] = (slots, staged, spare)
            if cuda:
                side.synchronize()

    # ------------------------------------------------------------------ 3. execute, abort, commit
    def _advance(self, codes: Sequence[int]) -> None:
        job = self._job
        if any(c == FAILED for c in codes) or (SKIPPED in codes and any(c > 0 for c in codes)):
            self._abort(codes)
        elif all(c == SKIPPED for c in codes):
            self._log("EPLB: no rebalance: %s", job.error)
            self._job = None
        elif all(c == 1 + len(job.chunks) for c in codes):
            self._commit()
        elif job.executed < len(job.chunks) and all(c == 1 + job.executed for c in codes):
            t0 = time.perf_counter()
            self._swap(job, job.chunks[job.executed], job.new)
            job.executed += 1
            job.stalls.append(time.perf_counter() - t0)
            self.report.num_stalls += 1
            self.report.stalls_s = [*self.report.stalls_s[-(MAX_KEPT - 1):], job.stalls[-1]]
            if job.executed == job.rounds[job.round][-1] + 1 and job.round + 1 < len(job.rounds):
                self._next_round(job)

    def _next_round(self, job: _Rebalance) -> None:
        """Every chunk of this round executed (on every rank, the same pass): the old experts the staging buffers
        now hold go to the host (an abort restores them from there), and the next round is prepared into the same
        buffers, in the background."""
        with torch.no_grad():
            for i, (slots, old, _) in job.staging.items():
                job.undo[i] = (slots, tuple(t.to("cpu", copy=True) for t in old))
        job.staging, job.round, job.result = {}, job.round + 1, WORKING

        def prepare() -> None:
            self._prepare(job)
            job.result = 1

        self._run(job, prepare)
    def _swap(self, job: _Rebalance, chunk: range, location: ExpertLocation) -> None:
        """Exchange the chunk's changed slots with their staging buffers: the slots' experts go to the spare
        buffers, the staged ones into the slots, and the two buffers trade roles (a second swap undoes the first);
        then the chunk's maps."""
        with torch.no_grad():
            for i in chunk:
                if i in job.staging:
                    slots, incoming, outgoing = job.staging[i]
                    for w, new, old in zip(self.layers[i].slot_weights(), incoming, outgoing, strict=True):
                        w, new, old = _copyable(w), _copyable(new), _copyable(old)
                        torch.index_select(w, 0, slots, out=old)
                        w.index_copy_(0, slots, new)
                    job.staging[i] = (slots, outgoing, incoming)
                self.layers[i].set_placement(location, i)
            if self.device.type == "cuda":
                self._serving_stream.synchronize()

    def _abort(self, codes: Sequence[int]) -> None:
        job = self._job
        done = job.rounds[job.round][0] if job.rounds else 0  # chunks of earlier rounds: their old experts are
        for c in reversed(range(done, job.executed)):  # on the host; this round's are in the staging buffers
            self._swap(job, job.chunks[c], self.location)
        with torch.no_grad():
            for i in (i for c in range(done) for i in job.chunks[c]):
                if i in job.undo:
                    slots, old = job.undo[i]
                    for w, t in zip(self.layers[i].slot_weights(), old, strict=True):
                        _copyable(w).index_copy_(0, slots, _copyable(t.to(w.device)))
                self.layers[i].set_placement(self.location, i)
        self.staged_bytes = 0
        failed = [r for r, c in enumerate(codes) if c == FAILED]
        why = job.error or f"rank(s) {failed} failed"
        self._log("EPLB: rebalance abandoned, the old placement serves on (%d of %d chunks undone): %s",
                  job.executed, len(job.chunks), why, warning=True)
        self._job = None

    def _commit(self) -> None:
        job = self._job
        old, new = self.location.physical_to_logical_map, job.new.physical_to_logical_map
        moved = int((old != new).sum())  # slots that got another expert, over every rank and layer
        moved_bytes = moved * sum(w[0].nbytes for w in self.layers[0].slot_weights())
        self.location.update_(job.new)
        self.report.rebalances += 1
        self.staged_bytes = 0
        self._log("EPLB: rebalanced %d MoE layers: balancedness %.3f -> %.3f on the window, %d experts moved "
                  "(%.1f MiB); plan %.0f ms, prepare %.0f ms (rank 0), execute in %d chunks, stall %.2f ms at most "
                  "per pass", self.location.num_layers, job.before, job.predicted, moved, moved_bytes / 2**20,
                  job.plan_s * 1e3, job.prepare_s * 1e3, len(job.chunks), max(job.stalls, default=0.0) * 1e3)
        self._job = None

    def _injected(self, phase: str) -> bool:
        return self.options.fail is not None and self.options.fail == (phase, self.ep_rank)


ALIGN = 256  # bytes: every staging buffer starts at a multiple


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class _Carver:
    """Staging buffers as views of one byte pool, in order (every round reuses the pool from its start)."""

    def __init__(self, pool: torch.Tensor):
        self.pool, self.offset = pool, 0

    def __call__(self, like: torch.Tensor, n: int) -> torch.Tensor:
        """An uninitialized [n, *like.shape[1:]] buffer of like's dtype."""
        nbytes = n * like[0].nbytes
        view = self.pool[self.offset:self.offset + nbytes].view(like.dtype).view(n, *like.shape[1:])
        self.offset += _aligned(nbytes)
        return view


def _copyable(t: torch.Tensor) -> torch.Tensor:
    """t, or its bytes where the CPU's index_select / index_copy_ do not take its dtype (float8): the same storage."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t

