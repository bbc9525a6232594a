"""--eplb-expert-weights memory keeps one host copy of the experts per node: 4 ranks (gloo, CPU), one node or two
(hostnames faked per rank). The ranks of a node map the same /dev/shm file (one inode, read from /proc/self/maps),
only the node's first rank fills it, every rank reads the same values, and no file is left behind."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeserve.models import expert_weights

NUMEL = 1 << 16
RANKS = 4


def _rank(rank: int, init_file: str, hosts: list[str], out: mp.Queue) -> None:
    socket.gethostname = lambda: hosts[rank]  # this process only
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=RANKS)
    fills = []

    def fill(flat: torch.Tensor) -> None:
        fills.append(rank)
        torch.arange(flat.numel(), out=flat)

    flat, ranks_on_node = expert_weights.node_shared_tensor(NUMEL, torch.float32, fill, dist.group.WORLD)
    maps = [line.split() for line in Path("/proc/self/maps").read_text().splitlines() if "moeserve-experts-" in line]
    inodes = {int(m[4]) for m in maps}
    ok = torch.equal(flat, torch.arange(NUMEL, dtype=torch.float32))
    dist.barrier()
    out.put((rank, fills, ranks_on_node, inodes, ok))
    dist.destroy_process_group()


@pytest.mark.parametrize("hosts", [["a"] * 4, ["a", "a", "b", "b"]], ids=["one_node", "two_nodes"])
def test_one_host_copy_per_node(tmp_path, hosts):
    before = set(os.listdir(expert_weights.SHM_DIR))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "init"), hosts, out)) for r in range(RANKS)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in range(RANKS))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    nodes = sorted(set(hosts), key=hosts.index)
    for rank, fills, ranks_on_node, inodes, ok in results:
        assert ok and len(inodes) == 1
        assert ranks_on_node == hosts.count(hosts[rank])
        assert fills == ([rank] if rank == hosts.index(hosts[rank]) else [])  # the node's first rank writes
    inode_of_node = {h: {next(iter(r[3])) for r in results if hosts[r[0]] == h} for h in nodes}
    assert all(len(v) == 1 for v in inode_of_node.values())  # one mapping shared by the node's ranks
    assert len(set().union(*inode_of_node.values())) == len(nodes)  # one copy per node, not per rank
    left = {f for f in set(os.listdir(expert_weights.SHM_DIR)) - before if f.startswith("moeserve-experts-")}
    assert not left


def test_a_full_shm_is_refused_by_name(monkeypatch, tmp_path):
    """Too little room in /dev/shm: a clear error before anything is written (a write past a full tmpfs is a
    SIGBUS)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        real = os.statvfs(expert_weights.SHM_DIR)
        monkeypatch.setattr(expert_weights.os, "statvfs", lambda _: os.statvfs_result(
            (real.f_bsize, real.f_frsize, real.f_blocks, 0, 0, *real[5:])))
        with pytest.raises(ValueError, match="eplb-expert-weights mmap"):
            expert_weights.node_shared_tensor(NUMEL, torch.float32, lambda flat: None, dist.group.WORLD)
    finally:
        dist.destroy_process_group()
