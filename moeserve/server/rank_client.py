"""RankClient: the server process's connection to the rank processes of one server (node 0's view).

It binds the ZeroMQ sockets (one PUSH socket per attention DP group, to that group's leader; one PULL socket
that every leader sends to), starts the ranks and waits until all report ready; once its owner (the
TokenizerManager) listens, it runs two threads: the receiver, which hands step outputs and loads to the owner and
resolves control replies, and the watchdog, which notices a rank process that died. A dead engine fails every waiting control
request and tells the owner, which fails its requests. Control requests go to every DP group and wait for one
reply from each. Starting and stopping the processes and their addresses are launch.py's.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing.connection as mp_connection
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import zmq

from moeserve.args import ServerArgs
from moeserve.rank.io_struct import (
    BatchTokenOut,
    ExpertDistributionOut,
    FlushCacheOut,
    LoadOut,
    ShutdownReq,
    TokenOut,
    WorkerError,
)
from moeserve.rank.worker import WorkerReady
from moeserve.server.launch import (
    bind_addr,
    cleanup_ipc,
    describe_exit,
    local_ranks,
    make_ports,
    start_workers,
    stop_workers,
)

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
CONTROL_REPLY_TIMEOUT_S = 60.0
FAILURE_GRACE_S = 0.5  # after a rank fails, how long the others have to exit or report before one is blamed

Reply = TypeVar("Reply")


class EngineDeadError(RuntimeError):
    """A rank worker died; the engine cannot serve any more."""


@dataclass
class _ControlWaiter:
    """A control request's wait for one reply of `reply_type` (from one DP group)."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    reply_type: type


class RankClient:
    """Sends messages to the rank processes and receives theirs. Constructing it starts the ranks and waits for
    them; `listen` then starts receiving."""

    def __init__(self, server_args: ServerArgs):
        self.server_args = server_args
        self.healthy = False
        self.dead_reason: str | None = None
        self._waiters: list[_ControlWaiter] = []
        self._worker_errors: list[WorkerError] = []  # fatal errors the ranks reported, in order
        self._failed = threading.Event()
        self._lock = threading.Lock()  # the waiters and the request sockets (ZeroMQ sockets are not thread-safe)
        self._closed = False

        self.ports = make_ports(server_args)
        self.num_dp = len(self.ports.request_addrs)
        self._zmq = zmq.Context()
        self._result_sock = self._zmq.socket(zmq.PULL)
        self._result_sock.bind(bind_addr(self.ports.result_addr))
        self._req_socks = []
        for addr in self.ports.request_addrs:
            s = self._zmq.socket(zmq.PUSH)
            s.bind(bind_addr(addr))
            self._req_socks.append(s)
        self.procs = start_workers(server_args, self.ports)
        self.local_ranks = list(local_ranks(server_args))  # the rank of each of self.procs
        try:
            self.ready = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise

    def listen(self, on_outputs: Callable[[list[TokenOut]], None], on_load: Callable[[LoadOut], None],
               on_dead: Callable[[str], None]) -> None:
        """`on_outputs` gets each step's token outputs and `on_load` each load a group reports, both on the
        receiver thread; `on_dead(reason)` is called once the engine is dead (on the receiver or the watchdog)."""
        self.on_outputs, self.on_load, self.on_dead = on_outputs, on_load, on_dead
        self.healthy = True
        self._receiver = threading.Thread(target=self._receive_loop, name="moeserve-recv", daemon=True)
        self._receiver.start()
        self._watchdog = threading.Thread(target=self._watch_workers, name="moeserve-watch", daemon=True)
        self._watchdog.start()

    # ------------------------------------------------------------------ start-up
    def _wait_ready(self) -> WorkerReady:
        """Wait for every rank's WorkerReady; the lowest rank's, which carries the facts the server needs."""
        expected = self.server_args.tp_size  # every rank of every node reports to node 0
        ready: list[WorkerReady] = []
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(ready) < expected:
            if self._result_sock.poll(200):
                msg = pickle.loads(self._result_sock.recv())
                if isinstance(msg, WorkerError):
                    raise RuntimeError(f"rank {msg.rank} failed to start: {msg.message}")
                if isinstance(msg, WorkerReady):
                    ready.append(msg)
            for p in self.procs:
                if p.exitcode is not None:
                    raise RuntimeError(f"worker {p.name} exited with code {p.exitcode} during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers did not start within {STARTUP_TIMEOUT_S:.0f} s")
        first = min(ready, key=lambda r: r.rank)
        logger.info("%d worker(s) ready: %s, context %d, KV %d tokens per group", expected, first.architecture,
                    first.context_length, first.num_kv_tokens)
        return first

    # ------------------------------------------------------------------ receive
    def _receive_loop(self) -> None:
        while not self._closed:
            try:
                if not self._result_sock.poll(100):
                    continue
                msg = pickle.loads(self._result_sock.recv())
            except zmq.ZMQError:
                if self._closed:
                    return
                raise
            if isinstance(msg, BatchTokenOut):
                if msg.load is not None:
                    self.on_load(msg.load)
                self.on_outputs(msg.outputs)
            elif isinstance(msg, LoadOut):  # the reply to GetLoadReq
                self.on_load(msg)
                self._resolve(LoadOut, msg)
            elif isinstance(msg, (FlushCacheOut, ExpertDistributionOut)):
                self._resolve(type(msg), msg)
            elif isinstance(msg, WorkerError):
                logger.error("rank %d failed: %s", msg.rank, msg.message)
                self._worker_errors.append(msg)
                self._failed.set()  # the watchdog decides which rank to blame

    def _resolve(self, kind: type, value: Any) -> None:
        """One reply of `kind` answers the oldest waiter for it (a control request waits for one per group)."""
        with self._lock:
            i = next((i for i, w in enumerate(self._waiters) if w.reply_type is kind), None)
            if i is None:
                return
            w = self._waiters.pop(i)
        w.loop.call_soon_threadsafe(lambda f=w.future, v=value: f.done() or f.set_result(v))

    def _watch_workers(self) -> None:
        """Wake at the first rank process that exits or reports a fatal error; give the others FAILURE_GRACE_S to
        follow (a rank killed by a signal takes its peers down with connection errors), then blame one."""
        sentinels = [p.sentinel for p in self.procs]
        while not self._closed:
            if mp_connection.wait(sentinels, timeout=0.2) or self._failed.is_set():
                break
        if self._closed:
            return
        time.sleep(FAILURE_GRACE_S)
        if not self._closed:
            self._mark_dead(self._failure_reason())

    def _failure_reason(self) -> str:
        """Which rank brought the engine down, and how: a rank killed by a signal, or one that exited without a
        word, before the ranks that then reported errors (often their lost connection to it)."""
        exits = [(rank, p) for rank, p in zip(self.local_ranks, self.procs, strict=True) if p.exitcode is not None]
        reported = {e.rank for e in self._worker_errors}
        culprits = ([(r, p) for r, p in exits if p.exitcode < 0]
                    or [(r, p) for r, p in exits if r not in reported and p.exitcode != 0])
        others = "; ".join(f"then rank {e.rank} failed: {e.message}" for e in self._worker_errors[:2])
        if culprits:
            rank, p = culprits[0]
            return f"rank {rank} (pid {p.pid}) {describe_exit(p.exitcode)}" + (f"; {others}" if others else "")
        if self._worker_errors:
            first = self._worker_errors[0]
            return f"rank {first.rank} failed: {first.message}"
        rank, p = exits[0] if exits else (-1, None)
        return f"rank {rank} (pid {p.pid if p else '?'}) {describe_exit(p.exitcode if p else None)}"

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            logger.error("engine is dead: %s", reason)
        self.dead_reason = self.dead_reason or reason
        self.healthy = False
        with self._lock:
            waiters, self._waiters = self._waiters, []
        self.on_dead(reason)
        for w in waiters:
            w.loop.call_soon_threadsafe(
                lambda f=w.future: f.done() or f.set_exception(EngineDeadError(reason)))

    # ------------------------------------------------------------------ send
    def send(self, dp_rank: int, msg: Any) -> None:
        """Send `msg` to the leader of attention group `dp_rank`; EngineDeadError once the engine is dead."""
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)
        with self._lock:
            self._req_socks[dp_rank].send(pickle.dumps(msg))

    async def control(self, msg: Any, reply_type: type[Reply]) -> list[Reply]:
        """Send `msg` to every DP group and wait for one `reply_type` from each (in the order they come)."""
        loop = asyncio.get_running_loop()
        futs = []
        for _ in range(self.num_dp):
            fut = loop.create_future()
            with self._lock:
                self._waiters.append(_ControlWaiter(loop, fut, reply_type))
            futs.append(fut)
        for d in range(self.num_dp):
            self.send(d, msg)
        return await asyncio.wait_for(asyncio.gather(*futs), timeout=CONTROL_REPLY_TIMEOUT_S)

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Stop the workers and free the sockets; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.healthy = False
        for s in self._req_socks:
            try:
                s.send(pickle.dumps(ShutdownReq()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        # a dead engine's surviving ranks may be stuck in a collective with the one that died: do not wait long
        stop_workers(getattr(self, "procs", []), timeout=1.0 if self.dead_reason else 10.0)
        for s in [*self._req_socks, self._result_sock]:
            s.close(linger=0)
        self._zmq.term()
        cleanup_ipc(self.ports)
