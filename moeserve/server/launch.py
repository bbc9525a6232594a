"""Starting, watching and stopping the rank worker processes of this node."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import tempfile
import time
import uuid

from moeserve.args import ServerArgs
from moeserve.rank.worker import WorkerPorts, worker_main

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_ports(args: ServerArgs) -> WorkerPorts:
    """Where the client and the workers meet, and the torch.distributed rendezvous address.

    One node: ipc:// endpoints in a private temp dir. Several nodes: tcp:// on node 0's --dist-init-addr host,
    the ports right after the torch.distributed port (result: port + 1, DP group d's requests: port + 2 + d), so
    every node derives the same addresses from the same command line.
    """
    num_dp = args.num_dp_groups
    if args.nnodes > 1:
        host, port = split_host_port(args.dist_init_addr)
        return WorkerPorts(request_addrs=[f"tcp://{host}:{port + 2 + d}" for d in range(num_dp)],
                           result_addr=f"tcp://{host}:{port + 1}", dist_init_method=f"tcp://{host}:{port}")
    base = os.path.join(tempfile.gettempdir(), f"moeserve-{uuid.uuid4().hex[:12]}")
    if args.dist_init_addr:
        init = f"tcp://{args.dist_init_addr}"
    else:
        init = f"tcp://127.0.0.1:{args.dist_port or free_port()}"
    return WorkerPorts(request_addrs=[f"ipc://{base}-req-{d}" for d in range(num_dp)],
                       result_addr=f"ipc://{base}-out", dist_init_method=init)


def split_host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--dist-init-addr must be HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


def bind_addr(addr: str) -> str:
    """The address the client binds: a tcp:// endpoint listens on every interface of node 0."""
    if addr.startswith("tcp://"):
        return "tcp://*:" + addr.rsplit(":", 1)[1]
    return addr


def run_worker_node(args: ServerArgs) -> int:
    """A node other than 0: start this node's ranks (they connect to node 0) and wait until they exit."""
    ports = make_ports(args)
    procs = start_workers(args, ports)
    logger.info("node %d: started ranks %s; waiting for node 0 (%s)", args.node_rank,
                list(local_ranks(args)), args.dist_init_addr)
    try:
        for p in procs:
            p.join()
    except KeyboardInterrupt:
        pass
    finally:
        stop_workers(procs, timeout=5)
    return max((p.exitcode or 0) for p in procs)


def local_ranks(args: ServerArgs) -> range:
    """Global ranks that run on this node."""
    per_node = args.tp_size // args.nnodes
    return range(args.node_rank * per_node, (args.node_rank + 1) * per_node)


def start_workers(args: ServerArgs, ports: WorkerPorts) -> list[mp.Process]:
    ctx = mp.get_context("spawn")
    procs = []
    for rank in local_ranks(args):
        p = ctx.Process(target=worker_main, args=(args, rank, ports), name=f"moeserve-rank{rank}", daemon=True)
        p.start()
        procs.append(p)
    return procs


def stop_workers(procs: list[mp.Process], timeout: float = 10.0) -> None:
    """Join the workers (they were asked to shut down) for up to `timeout` seconds in all; kill the ones that
    linger (they ignore SIGTERM: the server process decides when they stop)."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            logger.warning("rank process %s (pid %s) did not stop; killing it", p.name, p.pid)
            p.kill()
            p.join(2)


def describe_exit(exitcode: int | None) -> str:
    """A process's end in words: 'exited with code 1', 'was killed by signal 9 (SIGKILL)'."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            name = f" ({signal.Signals(-exitcode).name})"
        except ValueError:
            name = ""
        return f"was killed by signal {-exitcode}{name}"
    return f"exited with code {exitcode}"


def cleanup_ipc(ports: WorkerPorts) -> None:
    for addr in [*ports.request_addrs, ports.result_addr]:
        path = addr.removeprefix("ipc://")
        if path != addr and os.path.exists(path):
            try:
                os.unlink(path)
            except OSError:
                pass
