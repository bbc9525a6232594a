"""TokenizerManager: the server process's side of every request, for the HTTP layer and the offline `Engine`.

It validates and tokenizes a request, asks the DP controller which attention group gets it, sends it to the
ranks through the rank client, and turns the token ids that come back into outputs (incremental
detokenization, stop-string trimming, logprobs), one per chunk, to the asyncio loop that asked. It holds each
live request's state, ends requests on abort or when the engine dies, and answers the control requests (flush
cache, load, expert distribution) of every DP group.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeserve.args import PDRole, ServerArgs
from moeserve.core.model_config import ModelConfig
from moeserve.rank.io_struct import (
    AbortReq,
    ExpertDistributionOut,
    ExpertDistributionReq,
    FinishReason,
    FlushCacheOut,
    FlushCacheReq,
    GenerateReq,
    GetLoadReq,
    LoadOut,
    TokenOut,
)
from moeserve.rank.sampling_params import SamplingParams
from moeserve.server.detokenizer import IncrementalDetokenizer
from moeserve.server.dp_controller import DPController
from moeserve.server.rank_client import EngineDeadError, RankClient
from moeserve.server.validation import InvalidRequestError, RequestFailedError, RequestValidator

__all__ = ["DEFAULT_MODEL_NAME", "GenerateInput", "InvalidRequestError", "RequestFailedError", "TokenizerManager"]

DEFAULT_MODEL_NAME = "default"  # the embedded model's name, and a name every server answers to
INLINE_DETOKENIZE_IDS = 2048  # more new tokens than this in one output are detokenized in a worker thread


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
    logprob_start_len: int = -1  # with return_logprob: report the prompt's logprobs from this position on
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    data_parallel_rank: int | None = None  # the DP group to run in (default: the least loaded)
    local: bool = False  # PD mode: run here alone, no peer side (the server's own health check; not from HTTP)


def room_of(room: int | None, k: int) -> int | None:
    """The PD room of choice k of a request fanned out to several: both sides fan out alike, so they agree."""
    return None if room is None else (room + k) % (1 << 63)


@dataclass
class _ReqState:
    rid: str  # the client's id (unique among live requests)
    wire_id: str  # the ranks' id for it: unique for the server's life, so a late output of an earlier request
    # with the same rid (an abort the rank had not yet seen) can never reach this one
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    dp_rank: int
    num_tokens: int
    detok: IncrementalDetokenizer | None
    params: SamplingParams
    created: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, int, None]] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int, None]]] = field(default_factory=list)
    scored_prompt_ids: list[int] = field(default_factory=list)  # the prompt tokens input logprobs are for
    input_logprobs: list[tuple[float | None, int, None]] | None = None
    input_top_logprobs: list[list[tuple[float, int, None]]] | None = None
    sent_text_len: int = 0


class TokenizerManager:
    """The requests of one server (node 0's view) and the text of their outputs. Its parts come from
    server/startup.py, started; bootstrap: a prefill server's bootstrap server, else None."""

    def __init__(self, server_args: ServerArgs, model_config: ModelConfig, model_name: str, tokenizer: Any,
                 dp: DPController, ranks: RankClient, validator: RequestValidator, bootstrap: Any = None):
        self.server_args, self.model_config, self.model_name = server_args, model_config, model_name
        self.tokenizer, self.dp, self.ranks = tokenizer, dp, ranks
        self.validator, self.bootstrap = validator, bootstrap
        self.num_dp = server_args.num_dp_groups
        self.pd_role = server_args.disagg.role  # read once: every request asks it
        self._states: dict[str, _ReqState] = {}  # wire id -> live request
        self._rids: dict[str, _ReqState] = {}  # rid -> live request
        self._seq = 0
        self._lock = threading.Lock()  # the states and the DP controller's counts (the receiver thread too)
        self.context_length = ranks.ready.context_length
        self.vocab_size = ranks.ready.vocab_size
        self.max_total_tokens = ranks.ready.num_kv_tokens
        self.weight_format = ranks.ready.weight_format
        ranks.listen(on_outputs=self._deliver, on_load=self.dp.record_load, on_dead=self._fail_all)

    @property
    def healthy(self) -> bool:
        return self.ranks.healthy

    @property
    def dead_reason(self) -> str | None:
        return self.ranks.dead_reason

    @property
    def last_load(self) -> list[LoadOut]:
        """The latest load of each DP group (index: dp rank)."""
        return self.dp.last_load

    # ------------------------------------------------------------------ generate
    async def generate(self, obj: GenerateInput) -> AsyncGenerator[dict, None]:
        """Run one request; yields output dicts (one per chunk when streaming, else one at the end).

        Raises InvalidRequestError for a request it cannot serve, RequestFailedError when the ranks fail it,
        EngineDeadError once the engine is dead. Closing the generator early aborts the request on the ranks.
        """
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)
        ids = await self.validator.prompt_ids(obj.text, obj.input_ids)
        params = self.validator.params(obj.sampling_params, len(ids), obj.top_logprobs_num)
        if params.grammar is not None and self.pd_role is not PDRole.NULL and not obj.local:
            raise InvalidRequestError("structured outputs (json_schema, regex, ebnf, response_format) are not "
                                      "supported with PD disaggregation", param=params.grammar[0])
        await self.validator.check_grammar(params.grammar)
        start = obj.logprob_start_len if obj.return_logprob else -1
        if type(start) is not int or not -1 <= start < len(ids):
            raise InvalidRequestError(f"logprob_start_len must be -1 (output logprobs only) or a prompt position in "
                                      f"[0, {len(ids)}), got {start!r}", param="logprob_start_len")
        rid = obj.rid or uuid.uuid4().hex
        self._check_pd_fields(obj)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)
        with self._lock:
            if rid in self._rids:
                raise InvalidRequestError(f"request id {rid!r} is already in use", code="duplicate_rid", param="rid")
            if self.dead_reason:
                raise EngineDeadError(self.dead_reason)
            self._seq += 1
            num_tokens = len(ids) + params.max_new_tokens
            st = _ReqState(rid, f"{rid}#{self._seq}", asyncio.get_running_loop(), asyncio.Queue(),
                           self.dp.assign(num_tokens, self._pinned_dp_rank(obj)), num_tokens, detok, params)
            # a decode server's input logprobs are empty: prefill's come first (sglang-router prepends them)
            decode = self.pd_role is PDRole.DECODE
            st.scored_prompt_ids = ids[start:] if start >= 0 and not decode else []
            self._rids[rid] = st
            self._states[st.wire_id] = st
        req = GenerateReq(st.wire_id, ids, params, obj.return_logprob, obj.top_logprobs_num, obj.stream,
                          logprob_start_len=start, bootstrap_host=obj.bootstrap_host,
                          bootstrap_port=obj.bootstrap_port, bootstrap_room=obj.bootstrap_room, local=obj.local)
        finished = False
        if self.bootstrap is not None and not obj.local:
            self.bootstrap.assign_room(obj.bootstrap_room, st.dp_rank)
        try:
            self.ranks.send(st.dp_rank, req)
            while True:
                out = await st.queue.get()
                if isinstance(out, Exception):
                    raise out
                finished = out.finish_reason is not None
                _raise_failure(out.finish_reason)
                if len(out.new_token_ids) > INLINE_DETOKENIZE_IDS:  # a whole long answer at once: off the loop
                    result = await self.validator.off_loop(self._output, st, rid, out, len(ids))
                else:
                    result = self._output(st, rid, out, len(ids))
                if finished or obj.stream:
                    yield result
                if finished:
                    return
        finally:
            if self.bootstrap is not None:
                self.bootstrap.release_room(obj.bootstrap_room)
            if not finished:
                self._abort_state(st)

    def _pinned_dp_rank(self, obj: GenerateInput) -> int | None:
        """The DP group a request names, if any. A decode server picks its own group by load: the router sends both
        sides the same body, and there data_parallel_rank names the prefill side's group (as in SGLang)."""
        return None if self.pd_role is PDRole.DECODE else obj.data_parallel_rank

    def _check_pd_fields(self, obj: GenerateInput) -> None:
        """data_parallel_rank in range; in PD mode the three bootstrap fields (sglang-router adds them)."""
        pinned = self._pinned_dp_rank(obj)
        if pinned is not None and not 0 <= pinned < self.num_dp:
            raise InvalidRequestError(f"data_parallel_rank {obj.data_parallel_rank} is out of range: this server has "
                                      f"{self.num_dp} DP group(s)", param="data_parallel_rank")
        role = self.pd_role
        if role is PDRole.NULL or obj.local:
            return
        if obj.bootstrap_room is None or obj.bootstrap_host is None or obj.bootstrap_port is None:
            raise InvalidRequestError(f"this server runs --disaggregation-mode {role.value}: a request needs "
                                      "bootstrap_host, bootstrap_port and bootstrap_room (send it through sglang-router "
                                      "--pd-disaggregation)", param="bootstrap_room")
        if not 0 <= obj.bootstrap_room < 1 << 63:
            raise InvalidRequestError("bootstrap_room must be in [0, 2^63)", param="bootstrap_room")

    def _deliver(self, outs: list[TokenOut]) -> None:
        """Hand each output to its request's loop (receiver thread); a final one ends the request's state."""
        for out in outs:
            with self._lock:
                st = self._states.get(out.rid)
                if st is not None and out.finish_reason is not None:
                    self._forget(st)
            if st is not None:
                st.loop.call_soon_threadsafe(st.queue.put_nowait, out)

    def _forget(self, st: _ReqState) -> None:
        """Drop a request's state (under the lock): its rid is free again, its tokens leave its DP group's load."""
        del self._states[st.wire_id]
        if self._rids.get(st.rid) is st:
            del self._rids[st.rid]
        self.dp.release(st.dp_rank, st.num_tokens)

    def _fail_all(self, reason: str) -> None:
        """The engine died: every live request ends with EngineDeadError."""
        with self._lock:
            states, self._states, self._rids = self._states, {}, {}
        for st in states.values():
            st.loop.call_soon_threadsafe(st.queue.put_nowait, EngineDeadError(reason))

    def _output(self, st: _ReqState, rid: str, out: TokenOut, prompt_len: int) -> dict:
        """The output dict of one chunk: text and ids so far, this chunk's delta, and meta_info."""
        st.output_ids.extend(out.new_token_ids)
        if out.logprobs is not None:
            st.logprobs.extend((lp, t, None) for lp, t in zip(out.logprobs, out.new_token_ids, strict=False))
        if out.top_logprobs is not None:
            st.top_logprobs.extend([(lp, t, None) for t, lp in alts] for alts in out.top_logprobs)
        if out.input_logprobs is not None:
            st.input_logprobs = [(lp, t, None) for lp, t in zip(out.input_logprobs, st.scored_prompt_ids,
                                                                 strict=True)]
            if out.input_top_logprobs is not None:
                st.input_top_logprobs = [[(lp, t, None) for t, lp in alts] for alts in out.input_top_logprobs]
        finish = out.finish_reason
        text = self._text(st, out.new_token_ids, finish) if st.detok is not None else ""
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
        if out.spec_verify_ct is not None:
            meta["spec_verify_ct"] = out.spec_verify_ct
        if out.cached_tokens_details is not None:  # SGLang's split by tier, with the hierarchical cache
            meta["cached_tokens_details"] = dict(out.cached_tokens_details)
        if out.logprobs is not None:
            meta["output_token_logprobs"] = list(st.logprobs)
            if out.top_logprobs is not None:
                meta["output_top_logprobs"] = list(st.top_logprobs)
        if st.input_logprobs is not None:  # SGLang's fields, in every output once the prompt is scored
            meta["input_token_logprobs"] = list(st.input_logprobs)
            if st.input_top_logprobs is not None:
                meta["input_top_logprobs"] = list(st.input_top_logprobs)
        new_ids = out.new_token_ids
        return {"text": text, "output_ids": list(st.output_ids), "delta_text": delta, "delta_ids": new_ids,
                "meta_info": meta}

    @staticmethod
    def _text(st: _ReqState, new_ids: list[int], finish: FinishReason | None) -> str:
        """The request's text so far that may be sent: at the end, trimmed at the matched stop string; while it
        runs, without a tail that may be the start of a stop string."""
        assert st.detok is not None
        st.detok.add(new_ids)
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
        return text

    async def abort(self, rid: str) -> None:
        """End the live request `rid`: the ranks free its KV, and its generate() ends with finish reason 'abort'."""
        with self._lock:
            st = self._rids.get(rid)
        if st is not None:
            self._abort_state(st)

    def _abort_state(self, st: _ReqState) -> None:
        with self._lock:
            if self._states.get(st.wire_id) is not st:
                return  # finished or aborted already
            self._forget(st)
        done = TokenOut(st.wire_id, [], FinishReason("abort", message="aborted by request"), 0, len(st.output_ids), 0)
        st.loop.call_soon_threadsafe(st.queue.put_nowait, done)
        if not self.dead_reason:
            try:
                self.ranks.send(st.dp_rank, AbortReq(st.wire_id))
            except EngineDeadError:
                pass

    # ------------------------------------------------------------------ control
    async def flush_cache(self) -> bool:
        outs = await self.ranks.control(FlushCacheReq(), FlushCacheOut)
        return all(o.success for o in outs)

    async def expert_distribution(self, action: str) -> list[ExpertDistributionOut]:
        """start / stop / dump the expert-distribution recording on every group; ValueError if it cannot."""
        outs = await self.ranks.control(ExpertDistributionReq(action), ExpertDistributionOut)
        errors = sorted({o.error for o in outs if o.error})
        if errors:
            raise ValueError("; ".join(errors))
        return outs

    async def dump_expert_distribution(self, path: str | None = None) -> dict:
        """The groups' recorded windows in one .pt dump (moeserve/eplb/recorder.py: `logical_count` [1 or passes,
        MoE layers, experts], what `moeserve eplb` and --init-expert-location read, and per mode more); returns its
        path and totals."""
        import torch

        from moeserve.eplb.recorder import expert_distribution_dir, merge_dumps

        outs = await self.expert_distribution("dump")
        dump = merge_dumps([o.dump for o in outs], outs[0].mode)
        out = Path(path) if path else (expert_distribution_dir()
                                       / f"expert_distribution_recorder_{time.time_ns() // 1_000_000}.pt")
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(dump, out)
        counts = dump["logical_count"]
        return {"path": str(out), "mode": outs[0].mode, "num_layers": int(counts.shape[1]),
                "num_experts": int(counts.shape[2]), "token_expert_pairs": int(counts.sum())}

    async def get_load(self) -> list[LoadOut]:
        """Every DP group's load, fresh: each group answers a GetLoadReq with its LoadOut."""
        await self.ranks.control(GetLoadReq(), LoadOut)
        return list(self.last_load)

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Stop the workers and free the sockets; safe to call twice."""
        self.ranks.shutdown()
        if self.bootstrap is not None:
            self.bootstrap.close()
            self.bootstrap = None
        self.validator.shutdown()


def _raise_failure(finish: FinishReason | None) -> None:
    """A rank's 'abort' with a status code is a failure, not a stop: the request fails (400: the rank refused it;
    500: it could not go on), so that no client takes it for an answer."""
    if finish is None or finish.type != "abort" or finish.status_code is None:
        return
    message = finish.message or "the request failed"
    if finish.status_code == 400:
        raise InvalidRequestError(message)
    raise RequestFailedError(message, finish.status_code)
