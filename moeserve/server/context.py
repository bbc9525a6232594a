"""ServerContext: what every endpoint needs (the tokenizer manager, metrics, live requests), and SSE plumbing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.responses import Response, StreamingResponse

from moeserve.server.errors import APIError
from moeserve.server.metrics import Metrics
from moeserve.server.rank_client import EngineDeadError
from moeserve.server.streams import ClientGone, SubRequest, close_all, first_outputs, until_disconnect
from moeserve.server.tokenizer_manager import InvalidRequestError

DEFAULT_MODEL_ALIAS = "default"


class ServerContext:
    """The state of one HTTP server around one TokenizerManager."""

    def __init__(self, client: Any):
        self.client = client
        self.model_name: str = client.model_name
        self.metrics = Metrics(self.model_name)
        self.inflight: dict[str, SubRequest] = {}  # rid -> live sub-request, for /abort_request
        self.num_http_requests = 0  # generation requests being served, for max_concurrent_requests
        self.max_concurrent_requests: int = getattr(client.server_args, "max_concurrent_requests", 0) or 0
        self._token_text: dict[int, str] = {}

    # ------------------------------------------------------------------ model facts
    @property
    def tokenizer(self) -> Any:
        return self.client.tokenizer

    @property
    def context_length(self) -> int:
        return getattr(self.client, "context_length", None) or self.client.model_config.context_length

    @property
    def kv_capacity(self) -> int | None:
        """Most tokens one request can hold in the KV cache, when the engine says."""
        return getattr(self.client, "max_total_tokens", None)

    @property
    def model_names(self) -> set[str]:
        names = {self.model_name, DEFAULT_MODEL_ALIAS}
        if getattr(self.client.server_args, "model_path", None):
            names.add(self.client.server_args.model_path)
        return names

    def check_model(self, name: str | None) -> None:
        """OpenAI answers 404 model_not_found for a model it does not serve; so does moeserve."""
        if name is not None and name not in self.model_names:
            raise APIError(f"the model {name!r} does not exist: this server serves {self.model_name!r} "
                           "(see GET /v1/models)", 404, param="model", code="model_not_found")

    def token_bytes(self, token_id: int) -> bytes:
        tok = self.tokenizer
        if tok is None:
            return b""
        if hasattr(tok, "token_bytes"):
            return tok.token_bytes(token_id)
        return tok.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """One token's text for logprobs; a token holding part of a UTF-8 character is written 'bytes:\\xNN'
        (OpenAI's convention), so that distinct tokens never share a name."""
        text = self._token_text.get(token_id)
        if text is None:
            raw = self.token_bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            if len(self._token_text) < 1_000_000:
                self._token_text[token_id] = text
        return text

    # ------------------------------------------------------------------ requests
    def new_sub(self, obj: Any) -> SubRequest:
        if obj.rid in self.inflight:
            raise APIError(f"request id {obj.rid!r} is already in use", 400, param="rid", code="duplicate_rid")
        return SubRequest(self.client, obj, self.metrics, self.inflight)

    def enter(self) -> None:
        if self.max_concurrent_requests and self.num_http_requests >= self.max_concurrent_requests:
            raise APIError(f"the server is serving {self.num_http_requests} requests, its limit "
                           "(--max-concurrent-requests); retry later", 503, code="overloaded")
        if not getattr(self.client, "healthy", True):
            raise engine_error(EngineDeadError(self.client.dead_reason or "the engine is not running"))
        self.num_http_requests += 1

    def leave(self) -> None:
        self.num_http_requests -= 1


def engine_error(e: BaseException) -> APIError:
    """The HTTP error for an exception from the engine client."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequestError):
        return APIError(str(e), 400, param=_param_of(str(e)))
    if isinstance(e, EngineDeadError):
        return APIError(f"the engine is not running: {e}", 503, code="engine_dead")
    if isinstance(e, asyncio.TimeoutError):
        return APIError("the engine did not answer in time", 503, code="timeout")
    raise e


_PARAMS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
            "repetition_penalty", "stop_token_ids", "stop", "seed", "ignore_eos", "skip_special_tokens", "n",
            "input_ids", "text", "top_logprobs_num", "sampling_params")


def _param_of(message: str) -> str | None:
    """The request field an engine error message is about (its first word, or the prompt)."""
    first = message.split(" ", 1)[0].rstrip(":,")
    if first in _PARAMS:
        return first
    if "unknown sampling_params" in message:
        return "sampling_params"
    if "prompt" in message:
        return "prompt"
    return None


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """A server-sent-events stream that runs `on_close` however it ends (done, client gone, or error)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.on_close()


async def merged(subs: list[SubRequest], firsts: list[dict | None]) -> AsyncIterator[tuple[int, dict]]:
    """(index, output) of several sub-requests as they arrive, starting with their first outputs."""
    for i, out in enumerate(firsts):
        if out is not None:
            yield i, out
    if len(subs) == 1:
        sub = subs[0]
        while (out := await sub.next()) is not None:
            yield 0, out
        return
    pending = {asyncio.ensure_future(s.next()): i for i, s in enumerate(subs) if not s.finished}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t]):
                i = pending.pop(task)
                out = task.result()
                if out is not None:
                    yield i, out
                    if not subs[i].finished:
                        pending[asyncio.ensure_future(subs[i].next())] = i
    finally:
        for task in pending:
            task.cancel()


async def collect(subs: list[SubRequest]) -> list[dict]:
    """The final output of every sub-request, in order."""
    outs = []
    for sub in subs:
        try:
            outs.append(await sub.result())
        except Exception as e:  # noqa: BLE001
            raise engine_error(e) from None
    return outs


async def serve(ctx: ServerContext, request: Any, inputs: list[Any], stream: bool,
                respond: Callable[[list[dict]], Any],
                events: Callable[[list[SubRequest], list[dict | None]], AsyncIterator[str]]) -> Any:
    """Run the engine requests of one HTTP request; answer `respond(outputs)` or an SSE stream of `events`.

    Engine errors before the first output (a bad prompt, bad sampling params) become HTTP errors; a client that
    disconnects has its requests aborted, streamed or not.
    """
    ctx.enter()
    subs: list[SubRequest] = []
    streaming = False
    try:
        subs = [ctx.new_sub(obj).start() for obj in inputs]
        if not stream:
            try:
                return respond(await until_disconnect(request, collect(subs)))
            except ClientGone:
                return Response(status_code=499)
        try:
            firsts = await until_disconnect(request, first_outputs(subs))
        except ClientGone:
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001
            raise engine_error(e) from None

        async def on_close() -> None:
            await close_all(subs)
            ctx.leave()

        streaming = True
        return SSEResponse(events(subs, firsts), on_close)
    finally:
        if not streaming:
            await close_all(subs)
            ctx.leave()
