"""Peer memory for one-sided dispatch: one buffer per EP rank that every rank of the group can write, and a barrier.

    buffers = open_peer_buffers(nbytes, device, group, rank, size)   collective: every rank of the group calls it
    buffers.view(r, offset, shape, dtype)   a tensor over rank r's buffer (this rank's own when r == rank)
    buffers.arrive(); buffers.wait()        a split barrier: wait returns once every rank has arrived as often

Two kinds, the same contract:
- CUDA: torch's symmetric memory (`torch.distributed._symmetric_memory`: empty, rendezvous, get_buffer of a peer,
  the handle's barrier). A peer's buffer is a CUDA tensor of this device that points into the other GPU's memory.
  The barrier runs on the stream (no host sync, capturable). Written against torch 2.13; NOT run on a GPU yet.
- CPU ranks of one node: each rank's buffer is a file in /dev/shm mapped by every rank of the node (torch.from_file
  with shared=True), unlinked once all have mapped it (no file outlives the ranks). The barrier is one int64
  counter per rank in its own buffer: arrive stores this rank's arrival count, wait polls the others' until they
  reach it, with a deadline. On x86 stores become visible in program order, so the rows written before the
  counter are there when a peer sees it.

`peer_memory_unavailable` says why neither runs (ranks on several hosts, no symmetric memory in this torch), so
the caller can fall back by name instead of failing mid-step.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from abc import ABC, abstractmethod

import torch
import torch.distributed as dist

BARRIER_DEADLINE_S = 300.0  # a peer that has not arrived by then has died or hung
_SHM_DIR = "/dev/shm"
_ALIGN = 64  # bytes: every region a caller lays out starts on this


class PeerBuffers(ABC):
    """`nbytes` of memory on each rank of the group, addressable by every rank."""

    def __init__(self, nbytes: int, rank: int, size: int) -> None:
        self.nbytes, self.rank, self.size = nbytes, rank, size

    @abstractmethod
    def _storage(self, rank: int) -> torch.Tensor:
        """Rank `rank`'s buffer as uint8 [nbytes] (a peer's: mapped here)."""

    def view(self, rank: int, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A `dtype` tensor of `shape` at byte `offset` of rank `rank`'s buffer."""
        count = 1
        for s in shape:
            count *= s
        end = offset + count * dtype.itemsize
        assert offset % dtype.itemsize == 0 and end <= self.nbytes, (offset, shape, dtype, self.nbytes)
        return self._storage(rank)[offset:end].view(dtype).view(shape)

    @abstractmethod
    def arrive(self) -> None:
        """This rank's writes so far are done; peers may read what it wrote into their buffers."""

    @abstractmethod
    def wait(self) -> None:
        """Return once every rank has arrived as often as this one (what they wrote here is readable)."""


class SharedMemoryBuffers(PeerBuffers):
    """CPU ranks of one node: /dev/shm files mapped by every rank (see the module doc)."""

    def __init__(self, nbytes: int, group: dist.ProcessGroup | None, rank: int, size: int) -> None:
        super().__init__(nbytes, rank, size)
        token = [uuid.uuid4().hex if rank == 0 else None]
        dist.broadcast_object_list(token, group=group, group_src=0)
        paths = [os.path.join(_SHM_DIR, f"moeserve-ep-{token[0]}-{r}") for r in range(size)]
        total = _ALIGN + nbytes  # the first 8 bytes: this rank's barrier counter
        fd = os.open(paths[rank], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, total)  # ENOSPC here, not SIGBUS at the first write, where /dev/shm is small
        finally:
            os.close(fd)
        try:
            dist.barrier(group=group)
            self._maps = [torch.from_file(p, shared=True, size=total, dtype=torch.uint8) for p in paths]
            dist.barrier(group=group)  # everyone mapped every file: the names can go
        finally:
            os.unlink(paths[rank])
        self._counters = [m[:8].view(torch.int64) for m in self._maps]
        self._counters[rank].zero_()
        self._arrivals = 0

    def _storage(self, rank: int) -> torch.Tensor:
        return self._maps[rank][_ALIGN:]

    def arrive(self) -> None:
        self._arrivals += 1
        self._counters[self.rank].fill_(self._arrivals)

    def wait(self) -> None:
        deadline = time.monotonic() + BARRIER_DEADLINE_S
        pause = 1e-6
        for r, counter in enumerate(self._counters):
            while int(counter) < self._arrivals:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"EP rank {r} did not reach the dispatch barrier in {BARRIER_DEADLINE_S:.0f} s "
                                       f"(arrival {self._arrivals} of rank {self.rank})")
                time.sleep(pause)  # the ranks share the cores: yield rather than spin
                pause = min(pause * 2, 1e-3)


class SymmetricMemoryBuffers(PeerBuffers):
    """CUDA: torch's symmetric memory (see the module doc). NOT run on a GPU yet."""

    def __init__(self, nbytes: int, device: torch.device, group: dist.ProcessGroup | None, rank: int,
                 size: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        super().__init__(nbytes, rank, size)
        group = group if group is not None else dist.group.WORLD
        self._local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self._handle = symm_mem.rendezvous(self._local, group)
        assert self._handle.world_size == size and self._handle.rank == rank, (self._handle.rank, rank)
        self._peers = [self._local if r == rank else self._handle.get_buffer(r, (nbytes,), torch.uint8)
                       for r in range(size)]

    def _storage(self, rank: int) -> torch.Tensor:
        return self._peers[rank]

    def arrive(self) -> None:
        pass  # the handle's barrier both signals and waits (on the stream)

    def wait(self) -> None:
        self._handle.barrier(channel=0, timeout_ms=int(BARRIER_DEADLINE_S * 1000))


def _cuda_symmetric_memory_missing() -> str | None:
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:
        return f"torch.distributed._symmetric_memory does not import ({e})"
    if not all(hasattr(symm_mem, f) for f in ("empty", "rendezvous")):
        return f"this torch ({torch.__version__}) has no symmetric-memory empty/rendezvous"
    return None


def peer_memory_unavailable(device: torch.device | str, group: dist.ProcessGroup | None) -> str | None:
    """Why peer memory cannot run for this group on `device`, or None when it can. Collective (the same answer on
    every rank): the ranks compare their hosts and what each can do."""
    device = torch.device(device)
    if device.type == "cuda":
        local = _cuda_symmetric_memory_missing()
    elif device.type == "cpu":
        local = None if os.access(_SHM_DIR, os.W_OK) else f"{_SHM_DIR} is not writable"
    else:
        local = f"no peer memory for {device.type} tensors"
    mine = (socket.gethostname(), local)
    size = dist.get_world_size(group)
    everyone: list = [None] * size
    dist.all_gather_object(everyone, mine, group=group)
    hosts = {host for host, _ in everyone}
    if len(hosts) > 1:
        return f"the EP ranks span {len(hosts)} hosts; peer memory here is one node's"
    reasons = sorted({why for _, why in everyone if why is not None})
    return "; ".join(reasons) if reasons else None


def open_peer_buffers(nbytes: int, device: torch.device | str, group: dist.ProcessGroup | None, rank: int,
                      size: int) -> PeerBuffers:
    """This rank's PeerBuffers of `nbytes` (rounded up to 64) for the group; collective. The caller has checked
    peer_memory_unavailable."""
    device = torch.device(device)
    nbytes = -(-nbytes // _ALIGN) * _ALIGN
    if device.type == "cuda":
        return SymmetricMemoryBuffers(nbytes, device, group, rank, size)
    return SharedMemoryBuffers(nbytes, group, rank, size)
