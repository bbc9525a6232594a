"""The rank worker process: receives requests over ZeroMQ, runs scheduler steps, sends token ids back."""

from __future__ import annotations

import gc
import logging
import os
import pickle
import signal
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist
import zmq

from moeserve.args import ServerArgs
from moeserve.eplb.recorder import merge_dumps
from moeserve.rank.io_struct import (
    AbortReq,
    BatchTokenOut,
    ExpertDistributionOut,
    ExpertDistributionReq,
    FlushCacheOut,
    FlushCacheReq,
    GenerateReq,
    GetLoadReq,
    LoadOut,
    ShutdownReq,
    WorkerError,
)
from moeserve.rank.rank_sync import RankSync
from moeserve.rank.steps import StepPipeline
from moeserve.rank.watchdog import StepWatchdog

if TYPE_CHECKING:
    from moeserve.rank.model_runner import ModelRunner
    from moeserve.rank.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class WorkerPorts:
    """ZeroMQ endpoints: one request endpoint per DP group (bound by the client), one shared result endpoint."""

    request_addrs: list[str]  # index: dp rank
    result_addr: str
    dist_init_method: str  # torch.distributed rendezvous (unused for one rank)


@dataclass
class WorkerReady:
    rank: int
    dp_rank: int
    num_kv_tokens: int
    context_length: int
    vocab_size: int
    weight_bytes: int
    architecture: str
    weight_format: str  # models/loader.py weight_format: 'bfloat16', 'fp8 e4m3 128x128 blocks (+ bfloat16)', ...


def worker_main(server_args: ServerArgs, rank: int, ports: WorkerPorts) -> None:
    """Entry point of a rank process. Never raises: a fatal error is reported to the client, then we exit."""
    # The server process decides when workers stop (ShutdownReq, then kill): a Ctrl-C in the terminal, or the
    # SIGTERM that systemd and `kill -TERM -PGID` send to the whole group, must not kill a worker mid-step while
    # the server drains. A worker whose server died exits by itself (WorkerLoop._recv).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=server_args.log_level.upper(),
                        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    result_sock = ctx.socket(zmq.PUSH)
    result_sock.connect(ports.result_addr)
    try:
        _run(server_args, rank, ports, ctx, result_sock)
    except Exception as e:  # report, then die: the client marks the server unhealthy
        logger.error("worker failed:\n%s", traceback.format_exc())
        result_sock.send(pickle.dumps(WorkerError(rank, f"{type(e).__name__}: {e}")))
        time.sleep(0.2)
        os._exit(1)
    finally:
        result_sock.close(linger=1000)


def _run(server_args: ServerArgs, rank: int, ports: WorkerPorts, ctx: zmq.Context, result_sock) -> None:
    import torch

    from moeserve.constrained.registry import make_grammar_backend
    from moeserve.models.options import dispatch_options
    from moeserve.parallel.state import init_parallel_state
    from moeserve.rank.model_runner import ModelRunner
    from moeserve.rank.scheduler import Scheduler

    world = server_args.tp_size
    local_rank = rank % (world // server_args.nnodes)
    on_cuda = server_args.device == "cuda" or (server_args.device == "auto" and torch.cuda.is_available())
    if not on_cuda:
        # One core stays with the server process (HTTP, tokenizer); oversubscribed OpenMP threads spin-wait
        # on each other and can make a step ten times slower.
        torch.set_num_threads(max(1, ((os.cpu_count() or 1) - 1) // (world // server_args.nnodes)))
    if world > 1 or dispatch_options(server_args).needs_process_group:  # EP dispatchers talk through one
        import datetime

        if on_cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if on_cuda else "gloo", init_method=ports.dist_init_method,
                                world_size=world, rank=rank,
                                timeout=datetime.timedelta(seconds=server_args.dist_timeout or 1800))
    dp_size = server_args.num_dp_groups
    state = init_parallel_state(world, rank, dp_size, server_args.ep_size)
    sync = RankSync(state)
    runner = ModelRunner(server_args, local_rank=local_rank)
    tokenizer = None
    if not server_args.skip_tokenizer_init:
        from moeserve.text.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(server_args.tokenizer_path or server_args.model_path)
    dp_rank = state.dp_rank
    grammar = make_grammar_backend(server_args.grammar_backend, tokenizer, runner.vocab_size)
    scheduler = Scheduler.for_runner(server_args, runner, tokenizer=tokenizer, dp_rank=dp_rank, grammar=grammar)
    if server_args.disagg.enabled:
        from moeserve.rank.pd_host import make_pd_rooms

        scheduler.pd = make_pd_rooms(server_args, runner.kv_pool, runner.config, scheduler, dp_rank, sync,
                                     runner.draft_kv_pool)
    req_sock = None
    if sync.is_leader:
        req_sock = ctx.socket(zmq.PULL)
        req_sock.connect(ports.request_addrs[dp_rank])
    result_sock.send(pickle.dumps(WorkerReady(
        rank, dp_rank, runner.num_pages * server_args.page_size, runner.context_length, runner.vocab_size,
        runner.weight_bytes, runner.config.architecture, runner.weight_format)))
    loop = WorkerLoop(server_args, runner, scheduler, req_sock, result_sock, sync)
    # The model, its modules, the captured graphs and the imported libraries never die: out of the cyclic GC's
    # sight, a full collection under load scans only what serving made (a full one over the start-up heap paused
    # the host for milliseconds inside a step; scripts/gpu/prefill_stalls.py at 3438fba).
    gc.collect()
    gc.freeze()
    loop.run()


class WorkerLoop:
    """recv -> schedule -> forward -> sample -> send, until a ShutdownReq."""

    def __init__(self, args: ServerArgs, runner: ModelRunner, scheduler: Scheduler, req_sock: zmq.Socket | None,
                 result_sock: zmq.Socket, sync: RankSync):
        self.args = args
        self.runner = runner
        self.scheduler = scheduler
        self.req_sock = req_sock  # None on ranks that are not their group's leader
        self.result_sock = result_sock
        self.sync = sync
        self.poller = zmq.Poller()
        if req_sock is not None:
            self.poller.register(req_sock, zmq.POLLIN)
        self.pd = scheduler.pd
        self.steps = StepPipeline(scheduler, runner, sync, overlap=not args.disable_overlap_schedule)
        if self.pd is not None and self.pd.channel is not None:  # a message from the peer side wakes the loop too
            self.poller.register(self.pd.channel.sock, zmq.POLLIN)
        self.running = True
        self.server_pid = os.getppid()
        self.last_log = time.monotonic()
        self.last_counts = (0, 0, 0, 0)
        self.watchdog = StepWatchdog(args.watchdog_timeout)
        self.decode_steps = 0  # --decode-log-interval
        self.decode_log = (time.monotonic(), 0, 0, 0)  # (time, tokens generated, verify rounds, accepted drafts)

    def run(self) -> None:
        try:
            self._loop()
        finally:
            if self.pd is not None:
                self.pd.close()
                if self.pd.channel is not None:
                    self.pd.channel.close()
                self.pd.backend.close()
            self.scheduler.close()

    def _loop(self) -> None:
        while True:
            msgs = self._recv(block=not (self.scheduler.has_work() or self.steps.busy))
            if self.pd is None:
                msgs = self.sync.share_messages(msgs)
            else:  # the PD events go first: the new requests' rooms start at the leader's clock of this step
                msgs, events = self.sync.share_messages((msgs, self.pd.collect() if self.sync.is_leader else None))
                parts = [events]
                if self.pd.gathers:  # the other ranks' write results (GQA prefill)
                    parts = self.sync.gather_group(None if self.sync.is_leader else self.pd.collect())
                    parts[0] = events
                self.pd.apply(parts)
            for msg in msgs:
                self._handle(msg)
            stats = self.scheduler.stats
            stats.launched = None
            start = time.perf_counter()
            with self.watchdog.step():
                outs = self.steps.step(stop=not self.running)
            if stats.launched is not None:  # the call's wall time goes to the mode it launched
                stats.add_step_time(stats.launched, time.perf_counter() - start)
                if stats.launched.is_decode:
                    self._maybe_log_decode()
            if outs is None:
                break
            outs += self.scheduler.drain_pending()
            if outs and self.sync.is_leader:
                self._reply(BatchTokenOut(outs, self._load()))
            self._maybe_log()

    def _recv(self, block: bool) -> list:
        if self.req_sock is None:
            return []
        if block and os.getppid() != self.server_pid:  # orphaned: the server process is gone
            logger.error("the server process (pid %d) is gone; stopping", self.server_pid)
            return [ShutdownReq()]
        msgs = []
        timeout = 100 if block else 0
        if block and self.pd is not None and self.pd.busy:
            timeout = 2  # transfer threads and lookups finish without a message to wake us
        while True:
            ready = dict(self.poller.poll(timeout))
            if self.req_sock not in ready:
                return msgs
            timeout = 0
            msgs.append(pickle.loads(self.req_sock.recv()))

    def _reply(self, msg) -> None:
        if self.sync.is_leader:
            self.result_sock.send(pickle.dumps(msg))

    def _handle(self, msg) -> None:
        s = self.scheduler
        if isinstance(msg, GenerateReq):
            s.add_request(msg)
        elif isinstance(msg, AbortReq):
            s.abort(msg.rid)
        elif isinstance(msg, FlushCacheReq):
            ok = s.flush_cache()
            self._reply(FlushCacheOut(ok, "" if ok else "requests are in flight"))
        elif isinstance(msg, GetLoadReq):
            self._reply(self._load())
        elif isinstance(msg, ExpertDistributionReq):
            self._reply(self._expert_distribution(msg.action))
        elif isinstance(msg, ShutdownReq):
            self.running = False
        else:
            logger.warning("unknown message %r", type(msg).__name__)

    def _load(self) -> LoadOut:
        """This group's load; rank 0 adds the online rebalancer's counters."""
        load = self.scheduler.get_load()
        if self.runner.rebalancer is not None and self.sync.state.rank == 0:
            load.eplb = self.runner.rebalancer.snapshot()
        load.step_counts = self.runner.step_counts()
        return load

    def _expert_distribution(self, action: str) -> ExpertDistributionOut:
        """start / stop / dump on every rank of the group (they handle a message together); dump sums the group."""
        rec = self.runner.expert_recorder
        out = ExpertDistributionOut(self.scheduler.dp_rank)
        if rec is None:
            out.error = ("the server records no expert distribution: start it with "
                         "--expert-distribution-recorder-mode stat (or per_pass, per_token)")
        elif action == "start":
            rec.start()
        elif action == "stop":
            rec.stop()
        elif action == "dump":
            parts = [rec.dump()]
            if self.sync.group_size > 1:  # the group's ranks: the one that reports, or each its share of tokens
                parts = [None] * self.sync.group_size
                dist.all_gather_object(parts, rec.dump(), group=self.sync.state.attn_tp_cpu_group)
            out.mode, out.dump = rec.mode, merge_dumps(parts, rec.mode)
        else:
            out.error = f"unknown expert distribution action {action!r}"
        return out

    def _maybe_log_decode(self) -> None:
        """One line every --decode-log-interval decode steps (SGLang's 'Decode batch' line)."""
        self.decode_steps += 1
        if self.decode_steps % self.args.decode_log_interval:
            return
        st = self.scheduler.stats
        now, generated = time.monotonic(), st.generated
        dt = max(now - self.decode_log[0], 1e-9)
        rounds, accepted = st.spec_rounds - self.decode_log[2], st.spec_accepted - self.decode_log[3]
        load = self.scheduler.get_load()
        logger.info("decode step %d: running %d, queued %d, KV %d/%d tokens, %.1f tok/s%s over the last %d steps",
                    self.decode_steps, load.num_running, load.num_waiting, load.kv_used_tokens,
                    load.kv_total_tokens, (generated - self.decode_log[1]) / dt,
                    f", accept length {(accepted + rounds) / rounds:.2f}" if rounds else "",
                    self.args.decode_log_interval)
        self.decode_log = (now, generated, st.spec_rounds, st.spec_accepted)

    def _maybe_log(self) -> None:
        now = time.monotonic()
        dt = now - self.last_log
        if dt < self.args.log_interval_s:
            return
        st = self.scheduler.stats
        gen, pre = st.generated - self.last_counts[0], st.prefilled - self.last_counts[1]
        rounds, accepted = st.spec_rounds - self.last_counts[2], st.spec_accepted - self.last_counts[3]
        spec = f", accept length {(accepted + rounds) / rounds:.2f}" if rounds else ""
        steps = st.take_step_times(dt)
        if gen or pre or self.scheduler.has_work():
            load = self.scheduler.get_load()
            logger.info(
                "decode %.1f tok/s, prefill %.1f tok/s, running %d, queued %d, KV %d/%d tokens (%.1f%%), "
                "cached %d, retracted %d%s%s%s", gen / dt, pre / dt, load.num_running, load.num_waiting,
                load.kv_used_tokens, load.kv_total_tokens, 100 * load.kv_used_tokens / max(load.kv_total_tokens, 1),
                load.num_cached_tokens, st.retractions,
                f", mixed steps {st.mixed_steps}" if self.args.enable_mixed_chunk else "", spec, steps)
        util = self.runner.expert_utilization_line(dt)  # also on ranks whose own group is idle
        if util:
            logger.info("%s", util)
        self.last_log = now
        self.last_counts = (st.generated, st.prefilled, st.spec_rounds, st.spec_accepted)
