"""EngineClient: the server-side half of the engine.

It validates and tokenizes requests, picks an attention DP group for each (least load), sends them to the rank
workers over ZeroMQ, and turns the token ids that come back into text (incremental detokenization, stop-string
trimming). Both the HTTP server and the offline `Engine` use it. A receiver thread reads worker messages and
hands them to the asyncio loop of the request they belong to.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from moeserve.args import ServerArgs
from moeserve.models.default_model import resolve_model_path
from moeserve.rank.io_struct import (
    AbortReq,
    BatchTokenOut,
    ExpertDistributionOut,
    ExpertDistributionReq,
    FinishReason,
    FlushCacheOut,
    FlushCacheReq,
    GenerateReq,
    GetLoadReq,
    LoadOut,
    ShutdownReq,
    TokenOut,
    WorkerError,
)
from moeserve.rank.sampling_params import SamplingParams
from moeserve.rank.worker import WorkerReady
from moeserve.server.launch import bind_addr, cleanup_ipc, make_ports, start_workers, stop_workers

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0


class InvalidRequestError(ValueError):
    """The request is malformed or cannot be served (the HTTP layer answers 400)."""


class EngineDeadError(RuntimeError):
    """A rank worker died; the engine cannot serve any more."""


@dataclass
class GenerateInput:
    """One generation request, as text or token ids."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict | None = None
    rid: str | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


@dataclass
class _ReqState:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    dp_rank: int
    num_tokens: int
    detok: Any
    params: SamplingParams
    created: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, int, None]] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int, None]]] = field(default_factory=list)
    sent_text_len: int = 0


class EngineClient:
    """Talks to the rank workers of one server (one node's view)."""

    def __init__(self, server_args: ServerArgs):
        from moeserve.core.model_config import ModelConfig

        if server_args.node_rank != 0:
            raise ValueError("the engine client runs on node 0; other nodes run only their ranks "
                             "(moeserve serve with --node-rank > 0 does that)")
        resolve_model_path(server_args)
        self.server_args = server_args
        self.model_config = ModelConfig.from_pretrained(server_args.model_path)
        self.model_name = server_args.served_model_name or server_args.model_path
        self.tokenizer = None
        if not server_args.skip_tokenizer_init:
            from moeserve.text.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(server_args.tokenizer_path or server_args.model_path)
        self.healthy = False
        self.dead_reason: str | None = None
        self.num_dp = server_args.dp_size if server_args.enable_dp_attention else 1
        self.last_load: list[LoadOut] = [LoadOut(d, 0, 0, 0, 0, 0, 0) for d in range(self.num_dp)]
        self._live_tokens = [0] * self.num_dp  # tokens of requests sent to each DP group and not finished
        self._states: dict[str, _ReqState] = {}
        self._control_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future, type]] = []
        self._lock = threading.Lock()
        self._closed = False

        self.ports = make_ports(server_args)
        self._zmq = zmq.Context()
        self._result_sock = self._zmq.socket(zmq.PULL)
        self._result_sock.bind(bind_addr(self.ports.result_addr))
        self._req_socks = []
        for addr in self.ports.request_addrs:
            s = self._zmq.socket(zmq.PUSH)
            s.bind(bind_addr(addr))
            self._req_socks.append(s)
        self.procs = start_workers(server_args, self.ports)
        try:
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.healthy = True
        self._receiver = threading.Thread(target=self._receive_loop, name="moeserve-recv", daemon=True)
        self._receiver.start()
        self._watchdog = threading.Thread(target=self._watch_workers, name="moeserve-watch", daemon=True)
        self._watchdog.start()

    # ------------------------------------------------------------------ start-up
    def _wait_ready(self) -> None:
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
        self.context_length = first.context_length
        self.vocab_size = first.vocab_size
        self.max_total_tokens = first.num_kv_tokens
        logger.info("%d worker(s) ready: %s, context %d, KV %d tokens per group", expected, first.architecture,
                    self.context_length, self.max_total_tokens)

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
                    self.last_load[msg.load.dp_rank] = msg.load
                    self._resolve_control(LoadOut, msg.load)
                for out in msg.outputs:
                    self._deliver(out)
            elif isinstance(msg, (FlushCacheOut, ExpertDistributionOut)):
                self._resolve_control(type(msg), msg)
            elif isinstance(msg, WorkerError):
                self._mark_dead(f"rank {msg.rank} failed: {msg.message}")

    def _deliver(self, out: TokenOut) -> None:
        with self._lock:
            st = self._states.get(out.rid)
            if st is not None and out.finish_reason is not None:
                del self._states[out.rid]
                self._live_tokens[st.dp_rank] -= st.num_tokens
        if st is not None:
            st.loop.call_soon_threadsafe(st.queue.put_nowait, out)

    def _resolve_control(self, kind: type, value: Any) -> None:
        """One reply of `kind` answers the oldest waiter for it (a control request waits for one per group)."""
        with self._lock:
            i = next((i for i, w in enumerate(self._control_waiters) if w[2] is kind), None)
            if i is None:
                return
            loop, fut, _ = self._control_waiters.pop(i)
        loop.call_soon_threadsafe(lambda f=fut, v=value: f.done() or f.set_result(v))

    def _watch_workers(self) -> None:
        while not self._closed:
            for p in self.procs:
                if p.exitcode is not None and not self._closed:
                    self._mark_dead(f"worker {p.name} exited with code {p.exitcode}")
                    return
            time.sleep(0.5)

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            logger.error("engine is dead: %s", reason)
        self.dead_reason = self.dead_reason or reason
        self.healthy = False
        with self._lock:
            states, self._states = self._states, {}
            waiters, self._control_waiters = self._control_waiters, []
        for st in states.values():
            st.loop.call_soon_threadsafe(st.queue.put_nowait, EngineDeadError(reason))
        for loop, fut, _ in waiters:
            loop.call_soon_threadsafe(lambda f=fut: f.done() or f.set_exception(EngineDeadError(reason)))

    # ------------------------------------------------------------------ requests
    def _send(self, dp_rank: int, msg: Any) -> None:
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)
        with self._lock:
            self._req_socks[dp_rank].send(pickle.dumps(msg))

    def _broadcast(self, msg: Any) -> None:
        for d in range(self.num_dp):
            self._send(d, msg)

    def tokenize(self, obj: GenerateInput) -> list[int]:
        if obj.input_ids is not None:
            if obj.text is not None:
                raise InvalidRequestError("give either text or input_ids, not both")
            ids = obj.input_ids
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise InvalidRequestError("input_ids must be a list of integers")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"input_ids has token ids outside the vocabulary [0, {self.vocab_size}):"
                                          f" {bad[:5]}")
        elif obj.text is not None:
            if not isinstance(obj.text, str):
                raise InvalidRequestError("text must be a string")
            if not obj.text:
                raise InvalidRequestError("the prompt is empty")
            if self.tokenizer is None:
                raise InvalidRequestError("the server runs without a tokenizer (--skip-tokenizer-init): "
                                          "send input_ids")
            ids = self.tokenizer.encode(obj.text)
        else:
            raise InvalidRequestError("give text or input_ids")
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        return ids

    def make_params(self, obj: GenerateInput, prompt_len: int) -> SamplingParams:
        try:
            params = SamplingParams.from_dict(obj.sampling_params or {})
            params.validate(self.vocab_size)
        except (TypeError, ValueError) as e:
            raise InvalidRequestError(str(e)) from None
        if prompt_len >= self.context_length:
            raise InvalidRequestError(f"the prompt has {prompt_len} tokens, but the context length is "
                                      f"{self.context_length}")
        if prompt_len + params.max_new_tokens > self.context_length:
            raise InvalidRequestError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the context "
                f"length of {self.context_length}")
        if prompt_len + params.max_new_tokens > self.max_total_tokens:
            raise InvalidRequestError(
                f"prompt + max_new_tokens = {prompt_len + params.max_new_tokens} tokens exceeds the KV cache "
                f"({self.max_total_tokens} tokens)")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; use stop_token_ids")
        return params

    def pick_dp_rank(self) -> int:
        """The attention group with the least load: tokens of its live requests, then its KV usage."""
        return min(range(self.num_dp),
                   key=lambda d: (self._live_tokens[d] + self.last_load[d].num_waiting_tokens,
                                  self.last_load[d].kv_used_tokens))

    async def generate(self, obj: GenerateInput) -> AsyncIterator[dict]:
        """Run one request; yields output dicts (one per chunk when streaming, else one at the end)."""
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)
        ids = self.tokenize(obj)
        params = self.make_params(obj, len(ids))
        if not isinstance(obj.top_logprobs_num, int) or not 0 <= obj.top_logprobs_num <= 20:
            raise InvalidRequestError("top_logprobs_num must be an integer in [0, 20]")
        rid = obj.rid or uuid.uuid4().hex
        detok = None
        if self.tokenizer is not None:
            from moeserve.server.detokenizer import IncrementalDetokenizer

            detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)
        loop = asyncio.get_running_loop()
        with self._lock:
            if rid in self._states:
                raise InvalidRequestError(f"request id {rid!r} is already in use")
            dp = self.pick_dp_rank()
            st = _ReqState(loop, asyncio.Queue(), dp, len(ids) + params.max_new_tokens, detok, params)
            self._states[rid] = st
            self._live_tokens[dp] += st.num_tokens
        req = GenerateReq(rid, ids, params, obj.return_logprob, obj.top_logprobs_num, obj.stream,
                          obj.bootstrap_host, obj.bootstrap_port, obj.bootstrap_room)
        finished = False
        try:
            self._send(dp, req)
            while True:
                out = await st.queue.get()
                if isinstance(out, Exception):
                    raise out
                result = self._update(st, rid, out, len(ids))
                finished = out.finish_reason is not None
                if finished or obj.stream:
                    yield result
                if finished:
                    return
        finally:
            if not finished:
                await self.abort(rid)

    def _update(self, st: _ReqState, rid: str, out: TokenOut, prompt_len: int) -> dict:
        st.output_ids.extend(out.new_token_ids)
        if out.logprobs is not None:
            st.logprobs.extend((lp, t, None) for lp, t in zip(out.logprobs, out.new_token_ids, strict=False))
        if out.top_logprobs is not None:
            st.top_logprobs.extend([(lp, t, None) for t, lp in alts] for alts in out.top_logprobs)
        finish = out.finish_reason
        text = ""
        if st.detok is not None:
            st.detok.add(out.new_token_ids)
            text = st.detok.text
            if finish is not None:
                text += st.detok.flush()
            stops = st.params.stop
            stops = [stops] if isinstance(stops, str) else (stops or [])
            if finish is not None and isinstance(finish.matched, str) and not st.params.no_stop_trim:
                cut = text.find(finish.matched)
                if cut >= 0:
                    text = text[:cut]
            elif finish is None and stops:
                # hold back a tail that may be the start of a stop string, so it is never streamed
                text = text[: max(len(text) - (max(len(s) for s in stops) - 1), st.sent_text_len)]
        delta = text[st.sent_text_len :]
        st.sent_text_len = len(text)
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": finish.to_json() if finish else None,
            "prompt_tokens": prompt_len,
            "completion_tokens": len(st.output_ids),
            "cached_tokens": out.cached_tokens,
            "e2e_latency": time.perf_counter() - st.created,
        }
        if out.logprobs is not None:
            meta["output_token_logprobs"] = list(st.logprobs)
            if out.top_logprobs is not None:
                meta["output_top_logprobs"] = list(st.top_logprobs)
        new_ids = out.new_token_ids
        return {"text": text, "output_ids": list(st.output_ids), "delta_text": delta, "delta_ids": new_ids,
                "meta_info": meta}

    async def abort(self, rid: str) -> None:
        """End a request: the worker frees its KV, and its generate() ends with finish reason 'abort'."""
        with self._lock:
            st = self._states.pop(rid, None)
            if st is not None:
                self._live_tokens[st.dp_rank] -= st.num_tokens
        if st is None:
            return
        done = TokenOut(rid, [], FinishReason("abort", message="aborted by request"), 0, len(st.output_ids), 0)
        st.loop.call_soon_threadsafe(st.queue.put_nowait, done)
        if not self.dead_reason:
            self._send(st.dp_rank, AbortReq(rid))

    async def _control(self, msg: Any, reply: type, n: int) -> list:
        loop = asyncio.get_running_loop()
        futs = []
        for _ in range(n):
            fut = loop.create_future()
            with self._lock:
                self._control_waiters.append((loop, fut, reply))
            futs.append(fut)
        self._broadcast(msg)
        return await asyncio.wait_for(asyncio.gather(*futs), timeout=60)

    async def flush_cache(self) -> bool:
        outs = await self._control(FlushCacheReq(), FlushCacheOut, self.num_dp)
        return all(o.success for o in outs)

    async def expert_distribution(self, action: str) -> list[ExpertDistributionOut]:
        """start / stop / dump the expert-distribution recording on every group; ValueError if it cannot."""
        outs = await self._control(ExpertDistributionReq(action), ExpertDistributionOut, self.num_dp)
        errors = sorted({o.error for o in outs if o.error})
        if errors:
            raise ValueError("; ".join(errors))
        return outs

    async def dump_expert_distribution(self, path: str | None = None) -> dict:
        """Sum the groups' recorded windows into a .pt dump (`logical_count` [1, MoE layers, experts], what
        `moeserve eplb` and --init-expert-location read); returns its path and totals."""
        import torch

        from moeserve.eplb.recorder import expert_distribution_dir

        total = sum(o.logical_count for o in await self.expert_distribution("dump"))
        out = Path(path) if path else (expert_distribution_dir()
                                       / f"expert_distribution_recorder_{time.time_ns() // 1_000_000}.pt")
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"logical_count": total[None]}, out)
        return {"path": str(out), "num_layers": int(total.shape[0]), "num_experts": int(total.shape[1]),
                "token_expert_pairs": int(total.sum())}

    async def get_load(self) -> list[LoadOut]:
        await self._control(GetLoadReq(), LoadOut, self.num_dp)
        return list(self.last_load)

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
        stop_workers(getattr(self, "procs", []))
        for s in [*self._req_socks, self._result_sock]:
            s.close(linger=0)
        self._zmq.term()
        cleanup_ipc(self.ports)
