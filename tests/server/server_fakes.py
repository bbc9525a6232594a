"""Test helpers: FakeClient, an in-process stand-in for TokenizerManager with the same shape, for fast tests of
the HTTP layer.

It validates like the real client (same exceptions and SamplingParams checks) and "generates" a deterministic
token sequence per prompt, streamed one token at a time, honouring max_new_tokens, stop strings, stop token
ids, EOS (after `eos_after` tokens unless ignore_eos) and logprobs. It records every request and abort.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn

from moeserve.args import ServerArgs
from moeserve.rank.io_struct import ExpertDistributionOut, LoadOut
from moeserve.rank.sampling_params import SamplingParams
from moeserve.server.detokenizer import IncrementalDetokenizer
from moeserve.server.rank_client import EngineDeadError
from moeserve.server.tokenizer_manager import GenerateInput, InvalidRequestError
from moeserve.server.validation import RequestValidator, check_fits_context


@dataclass
class FakeModelConfig:
    context_length: int
    vocab_size: int
    architecture: str


class FakeClient:
    def __init__(self, tokenizer: Any, context_length: int = 512, api_key: str | None = None,
                 max_concurrent_requests: int = 4096, model_path: str = "/models/fake", **server_args: Any):
        self.server_args = ServerArgs(model_path=model_path, served_model_name="fake-model", api_key=api_key,
                                      max_concurrent_requests=max_concurrent_requests, **server_args)
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size if tokenizer is not None else 1024
        self.context_length = context_length
        self.max_total_tokens = 100_000
        self.weight_format = "bfloat16"
        self.model_config = FakeModelConfig(context_length, self.vocab_size, "DeepseekV3ForCausalLM")
        self.validator = RequestValidator(tokenizer, self.vocab_size, context_length, self.max_total_tokens)
        self.model_name = "fake-model"
        self.healthy = True
        self.dead_reason: str | None = None
        self.last_load = [LoadOut(0, 0, 0, 0, 0, 1000, 0)]
        self.token_delay = 0.0  # seconds per generated token
        self.eos_after: int | None = None  # emit EOS as this output token (unless ignore_eos)
        self.script: list[int] | None = None  # the output tokens of every request (then EOS), when set
        self.requests: list[GenerateInput] = []
        self.aborted: list[str] = []
        self.running: dict[str, GenerateInput] = {}
        self.flushed = 0
        self.shut_down = False

    # ------------------------------------------------------------------
    def tokenize(self, obj: GenerateInput) -> list[int]:
        if obj.input_ids is not None:
            if obj.text is not None:
                raise InvalidRequestError("give either text or input_ids, not both")
            bad = [t for t in obj.input_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"input_ids has token ids outside the vocabulary [0, {self.vocab_size}):"
                                          f" {bad[:5]}")
            ids = list(obj.input_ids)
        elif obj.text is not None:
            self.validator.check_text_len(len(obj.text))
            ids = self.tokenizer.encode(obj.text)
        else:
            raise InvalidRequestError("give text or input_ids")
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        return ids

    @staticmethod
    def token_at(ids: list[int], k: int, seed: int) -> int:
        """The k-th output token of a prompt: deterministic, never a special token (ids 0..4)."""
        return 5 + (sum(ids) * 31 + len(ids) * 17 + k * 7 + seed * 13) % 250

    async def generate(self, obj: GenerateInput):
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)
        ids = self.tokenize(obj)
        try:
            params = SamplingParams.from_dict(obj.sampling_params or {})
            params.validate(self.vocab_size)
        except (TypeError, ValueError) as e:
            raise InvalidRequestError(str(e)) from None
        self.validator.check_prompt_len(len(ids))
        check_fits_context(len(ids), params.max_new_tokens, self.context_length)
        if not 0 <= obj.top_logprobs_num <= 20:
            raise InvalidRequestError("top_logprobs_num must be an integer in [0, 20]")
        rid = obj.rid or uuid.uuid4().hex
        if rid in self.running:
            raise InvalidRequestError(f"request id {rid!r} is already in use", code="duplicate_rid", param="rid")
        self.requests.append(obj)
        self.running[rid] = obj
        done = False
        try:
            async for out in self._run(obj, rid, ids, params):
                done = out["meta_info"]["finish_reason"] is not None
                yield out
        finally:
            self.running.pop(rid, None)
            if not done:  # closed early, as the TokenizerManager's generator aborts its request on the ranks
                self.aborted.append(rid)

    async def _run(self, obj: GenerateInput, rid: str, ids: list[int], params: SamplingParams):
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens) if self.tokenizer else None
        out_ids: list[int] = []
        logprobs: list = []
        tops: list = []
        sent = 0
        stops = params.stop_strs
        for k in range(params.max_new_tokens):
            if self.token_delay:
                await asyncio.sleep(self.token_delay)
            else:
                await asyncio.sleep(0)
            if self.script is not None:
                tok = self.script[k] if k < len(self.script) else 1
            elif self.eos_after is not None and k == self.eos_after and not params.ignore_eos:
                tok = 1
            else:
                tok = self.token_at(ids, k, params.seed or 0)
            out_ids.append(tok)
            logprobs.append((-0.5 - 0.01 * k, tok, None))
            if obj.top_logprobs_num:
                tops.append([(-0.5 - 0.01 * k - a, tok + a, None) for a in range(obj.top_logprobs_num)])
            finish = None
            if tok == 1 and not params.ignore_eos:
                finish = {"type": "stop", "matched": 1}
            elif tok in (params.stop_token_ids or []):
                finish = {"type": "stop", "matched": tok}
            text = ""
            if detok is not None:
                detok.add([tok])
                text = detok.text
                hit = [(text.find(s), s) for s in stops if s in text]
                if hit and finish is None:
                    cut, s = min(hit)
                    finish = {"type": "stop", "matched": s}
                    if not params.no_stop_trim:
                        text = text[:cut]
            if finish is None and k == params.max_new_tokens - 1:
                finish = {"type": "length", "matched": None}
                if detok is not None:
                    text = text + detok.flush()
            meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(ids),
                    "completion_tokens": len(out_ids), "cached_tokens": 0, "e2e_latency": 0.01}
            if obj.return_logprob:
                meta["output_token_logprobs"] = list(logprobs)
                if obj.top_logprobs_num:
                    meta["output_top_logprobs"] = list(tops)
            out = {"text": text, "output_ids": list(out_ids), "delta_text": text[sent:], "delta_ids": [tok],
                   "meta_info": meta}
            sent = len(text)
            if obj.stream or finish is not None:
                yield out
            if finish is not None:
                return

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    async def flush_cache(self) -> bool:
        self.flushed += 1
        return not self.running

    async def get_load(self) -> list[LoadOut]:
        return list(self.last_load)

    async def expert_distribution(self, action: str) -> list[ExpertDistributionOut]:
        raise ValueError("the server records no expert distribution: start it with "
                         "--expert-distribution-recorder-mode stat")

    async def dump_expert_distribution(self, path: str | None = None) -> dict:
        await self.expert_distribution("dump")
        return {}

    def shutdown(self) -> None:
        self.shut_down = True


@contextlib.contextmanager
def serve_in_thread(app, server_cls: type = uvicorn.Server, holder: dict | None = None, **config_kw) -> Iterator[str]:
    """Serve `app` with uvicorn in a background thread; yields its base URL (the server goes in `holder`)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=1, **config_kw)
    server = server_cls(config)
    if holder is not None:
        holder["server"] = server
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def sse_events(text: str) -> list:
    """The JSON events of an SSE body, checking that it ends with [DONE]."""
    lines = [line for line in text.split("\n\n") if line.strip()]
    assert lines[-1] == "data: [DONE]", lines[-1]
    assert all(line.startswith("data: ") for line in lines)
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)
