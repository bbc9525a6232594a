"""The symmetric-memory dispatcher (`--moe-a2a-backend symm`): low-latency dispatch whose bytes scale with routed
tokens, at static shapes (no host sync on CUDA, capturable).

The all2all low-latency dispatcher (all2all_low_latency.py) sends every rank its whole [cap, H] slot each step,
whatever the routing. Here each rank WRITES only the rows a peer needs straight into that peer's memory
(peer_memory.py: torch's symmetric memory on CUDA, /dev/shm on the CPU ranks of one node):

- every rank's buffer holds a receive region per source rank: rows [R, cap, W] (x, or FP8 [scales | e4m3], then
  the k local expert ids and weights), a row count per source [R] and the combine region [R, cap, H]. A source
  owns its region of each receiver, so no two ranks write the same bytes and no atomics are needed.
- dispatch: per peer p, the tokens with an expert on p go first (a stable order), and `put_rows` copies the first
  count[p] of them into p's region [me] (kernels/put_rows.py: the count stays on the device); count[p] goes to
  p's count slot [me]. Then the barrier. A token reaches a rank once, with its local ids and weights.
- the receiver masks rows past each source's count and builds the same MaskedLayout [E_local, C, H] as the
  all2all low-latency dispatcher (the same routing helpers and round logic: this class is its subclass with
  another transport).
- combine: the owner sums each received row's experts (fp32, cast to x's dtype) and puts row j of source s back
  into s's combine region [owner, j], count[s] rows; after the barrier the source gathers, for each token, the
  rows of the ranks that hold its experts and sums them in fp32.

Bytes a rank sends per round: (rows it routed to other ranks) x W + 4 x (R - 1) for the counts, and for combine
(rows it received from other ranks) x H x itemsize: `comm_bytes` reads them from device counters (reading
syncs; the step itself never does).

Barriers: one after each side's writes. A rank writes a peer's region only after a barrier that the peer passed
after reading that region's previous contents: dispatch writes of step n+1 follow combine's barrier of step n
(every rank read its dispatch rows before), combine's writes follow the dispatch barrier of the same step (every
rank read its combine rows of the step before). Rounds after the first add a barrier before their writes.

What has run: the CPU path through shared memory (tests/ep, 2 and 4 ranks). The CUDA path (symmetric memory,
the Triton put) is written but NOT run on GPUs yet.
"""

from __future__ import annotations

import torch

from moeserve.ep.all2all import All2AllDispatcher
from moeserve.ep.all2all_low_latency import LowLatencyDispatcher
from moeserve.ep.peer_memory import PeerBuffers, open_peer_buffers, peer_memory_unavailable
from moeserve.ep.routing import combine_masked, pack_meta, unpack_meta
from moeserve.kernels.put_rows import put_rows

_ALIGN = 64


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class SymmLowLatencyDispatcher(LowLatencyDispatcher):
    """Low-latency dispatch by one-sided row puts into peer memory (see the module doc)."""

    name = "symm"
    graph_safe = extend_graph_safe = True

    def _allocate(self) -> None:
        r, cap, h = self.size, self.cap, self.hidden_size
        self._x_words = -(-self._row_bytes // 4)
        self._words = self._x_words + 2 * self.topk  # a dispatch row: x (or FP8 bytes), local ids, weights
        self.dispatch_row_bytes = 4 * self._words
        self.combine_row_bytes = h * self.dtype.itemsize
        self._rows_at, self._counts_at = 0, _aligned(r * cap * self.dispatch_row_bytes)
        self._back_at = self._counts_at + _aligned(4 * r)
        nbytes = self._back_at + _aligned(r * cap * self.combine_row_bytes)
        self._peers: PeerBuffers = open_peer_buffers(nbytes, self.device, self.group, self.rank, self.size)
        # Per peer p: my region in p's buffer (rows, the count slot, combine rows); my own buffer whole.
        me = self.rank
        self._to_rows = [self._peers.view(p, self._rows_at + me * cap * self.dispatch_row_bytes, (cap, self._words),
                                          torch.int32) for p in range(r)]
        self._to_count = [self._peers.view(p, self._counts_at + 4 * me, (1,), torch.int32) for p in range(r)]
        self._to_back = [self._peers.view(p, self._back_at + me * cap * self.combine_row_bytes, (cap, h), self.dtype)
                         for p in range(r)]
        self._rows = self._peers.view(me, self._rows_at, (r * cap, self._words), torch.int32)
        self._counts = self._peers.view(me, self._counts_at, (r,), torch.int32)
        self._back = self._peers.view(me, self._back_at, (r * cap, h), self.dtype)
        self._send = torch.empty(r, cap, self._words, dtype=torch.int32, device=self.device)  # staging, local
        self._send_back = torch.empty(r * cap, h, dtype=self.dtype, device=self.device)
        self._positions = torch.arange(cap, device=self.device)
        self._peer_mask = torch.ones(r, dtype=torch.bool, device=self.device)
        self._peer_mask[me] = False
        self._sent = torch.zeros(2, dtype=torch.int64, device=self.device)  # bytes: dispatch, combine

    def describe(self) -> str:
        fp8 = ", FP8 dispatch" if self.fp8 else ""
        return f"symm low_latency, peer memory for {self.cap} tokens x {self.size} ranks, routed rows only{fp8}"

    def buffer_bytes(self) -> int:
        return self._peers.nbytes + self._send.nbytes + self._send_back.nbytes

    def _reset(self) -> None:
        super()._reset()
        self._sent_orders: list[tuple[torch.Tensor, torch.Tensor]] = []  # per round: (hit [R, n], position [R, n])
        self._recv_counts: list[torch.Tensor] = []  # per round: [R] rows each source sent here

    @property
    def comm_bytes(self) -> dict[str, int]:  # the device counters, read back (a sync: benchmarks and tests only)
        dispatch, combine = self._sent.tolist()
        return {"dispatch": dispatch, "combine": combine}

    def _count_bytes(self) -> None:
        self._sent.zero_()

    def _barrier(self) -> None:
        self._peers.arrive()
        self._peers.wait()

    # ------------------------------------------------------------------------------------------------------------
    # dispatch

    def _send_dispatch(self, i: int) -> None:
        if i > 0:  # every rank has read round i - 1's rows
            self._barrier()
        lo, hi = self._chunk(i)
        n, r = hi - lo, self.size
        self._pack_rows(self._send.view(torch.uint8)[..., : self._row_bytes].view(
            torch.uint8 if self.fp8 else self.dtype), lo, hi)
        local_ids, weights = self._local_meta(lo, hi)  # [R, n, k]
        self._send[:, :n, self._x_words :] = pack_meta(local_ids, weights)
        hit = (local_ids >= 0).any(-1)  # [R, n]: token t has an expert on rank p
        order = torch.sort((~hit).to(torch.int8), dim=1, stable=True).indices  # routed tokens first, in order
        position = torch.empty_like(order)
        position.scatter_(1, order, torch.arange(n, device=self.device).expand(r, n))
        counts = hit.sum(1, dtype=torch.int32)  # [R]
        self._sent_orders.append((hit, position))
        for p in range(r):
            put_rows(self._send[p, :n], order[p], counts[p : p + 1], self._to_rows[p])
            self._to_count[p].copy_(counts[p : p + 1])
        self._sent[0] += (counts * self._peer_mask).sum() * self.dispatch_row_bytes + 4 * (r - 1)
        self._peers.arrive()

    def _receive_dispatch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self._peers.wait()
        counts = self._counts.clone()  # [R]; the next round overwrites the slots
        self._recv_counts.append(counts)
        valid = (self._positions.view(1, -1) < counts.view(-1, 1)).view(-1, 1)  # [R * cap, 1]
        local_ids, weights = unpack_meta(self._rows[:, self._x_words :])
        local_ids = torch.where(valid, local_ids, -1)  # rows past a source's count are stale
        weights = torch.where(valid, weights, 0.0)
        rows = self._rows.view(torch.uint8)[:, : self._row_bytes]
        return (rows if self.fp8 else rows.view(self.dtype)), local_ids, weights

    # ------------------------------------------------------------------------------------------------------------
    # combine

    def _send_combine(self, i: int) -> None:
        if i > 0:  # every rank has read round i - 1's results
            self._barrier()
        self._send_back.copy_(combine_masked(self._out_flat, self._plans[i]))  # weighted, fp32 sum, cast
        counts, cap = self._recv_counts[i], self.cap
        for s in range(self.size):
            put_rows(self._send_back[s * cap : (s + 1) * cap], None, counts[s : s + 1], self._to_back[s])
        self._sent[1] += (counts * self._peer_mask).sum() * self.combine_row_bytes
        self._peers.arrive()

    def _receive_combine(self, i: int, n: int) -> torch.Tensor:
        self._peers.wait()
        hit, position = self._sent_orders[i]
        ranks = torch.arange(self.size, device=self.device).view(-1, 1)
        rows = torch.where(hit, ranks * self.cap + position, 0)  # [R, n] rows of the combine region
        picked = self._back.index_select(0, rows.view(-1)).view(self.size, n, self.hidden_size).float()
        picked.masked_fill_(~hit.unsqueeze(-1), 0.0)  # rows not sent may hold anything
        return picked.sum(0).to(self.dtype)


class SymmAll2AllDispatcher(All2AllDispatcher):
    """`--moe-a2a-backend symm`: the all2all backend's modes (--deepep-mode) with the symmetric-memory transport for
    low-latency steps; normal mode (prefill under auto) is all2all's."""

    name = "symm"
    low_latency_cls = SymmLowLatencyDispatcher


_UNAVAILABLE: dict[tuple[str, int], str | None] = {}


def symm_unavailable(device: torch.device | str, group) -> str | None:
    """Why the symm backend cannot run for this EP group here, or None; asked once per (device type, group)
    (collective the first time)."""
    key = (torch.device(device).type, id(group))
    if key not in _UNAVAILABLE:
        _UNAVAILABLE[key] = peer_memory_unavailable(device, group)
    return _UNAVAILABLE[key]
