"""How one HTTP request's engine requests become its response: one JSON body, or a server-sent-events stream.

`serve` runs the sub-requests of an HTTP request (streams.py) and answers `respond(outputs)` or an SSE
stream of `events`; `merged` interleaves several sub-requests' outputs as they arrive; `sse` writes one event.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.responses import Response, StreamingResponse

from moeserve.server.http.context import ServerContext
from moeserve.server.http.errors import engine_error
from moeserve.server.http.streams import ClientGone, SubRequest, close_all, first_outputs, until_disconnect
from moeserve.server.tokenizer_manager import GenerateInput


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


async def serve(ctx: ServerContext, request: Any, inputs: list[GenerateInput], stream: bool,
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
