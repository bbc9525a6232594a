"""Starting, watching and stopping the rank worker processes of this node."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import tempfile
import uuid

from moeserve.args import ServerArgs
from moeserve.engine.worker import WorkerPorts, worker_main

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_ports(args: ServerArgs) -> WorkerPorts:
    """ipc:// endpoints in a private temp dir, and the torch.distributed rendezvous address."""
    base = os.path.join(tempfile.gettempdir(), f"moeserve-{uuid.uuid4().hex[:12]}")
    if args.dist_init_addr:
        init = f"tcp://{args.dist_init_addr}"
    else:
        init = f"tcp://127.0.0.1:{args.dist_port or free_port()}"
    return WorkerPorts(
        request_addrs=[f"ipc://{base}-req-{d}" for d in range(args.dp_size if args.enable_dp_attention else 1)],
        result_addr=f"ipc://{base}-out",
        dist_init_method=init,
    )


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
    """Join the workers (they were asked to shut down); terminate, then kill, the ones that linger."""
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(3)
        if p.is_alive():
            p.kill()
            p.join(1)


def cleanup_ipc(ports: WorkerPorts) -> None:
    for addr in [*ports.request_addrs, ports.result_addr]:
        path = addr.removeprefix("ipc://")
        if path != addr and os.path.exists(path):
            try:
                os.unlink(path)
            except OSError:
                pass
