"""SubRequest: one generation the HTTP layer runs on the engine, that it can end from outside.

An HTTP request fans out into sub-requests (one per prompt, times `n`). Each runs the engine's `generate` in a
task that pushes outputs into a queue; the handler reads the queue. Going through a queue lets three things
end a request cleanly whatever the engine is doing: its natural end, `/abort_request` (a final output with
finish_reason abort) and a client that goes away (`close()`: the task is cancelled and the engine told to
abort, so the request's KV pages are freed). Latency metrics are observed here as outputs arrive.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import anyio

from moeserve.server.http.metrics import Metrics
from moeserve.server.http.serving_client import ServingClient
from moeserve.server.tokenizer_manager import GenerateInput

_END = object()


class _Abort:
    def __init__(self, message: str):
        self.message = message


class SubRequest:
    """One engine request (`obj` is a GenerateInput whose rid is set) and its outputs."""

    def __init__(self, client: ServingClient, obj: GenerateInput, metrics: Metrics | None,
                 registry: dict[str, SubRequest]):
        assert obj.rid, "the server names every request"
        self.client = client
        self.obj = obj
        self.rid: str = obj.rid
        self.metrics = metrics
        self.registry = registry
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task: asyncio.Task | None = None
        self.last: dict | None = None  # the latest output
        self.finished = False
        self.created = time.perf_counter()
        self._last_chunk_time: float | None = None

    def start(self) -> SubRequest:
        self.registry[self.rid] = self
        self.task = asyncio.create_task(self._pump(), name=f"moeserve-req-{self.rid}")
        return self

    async def _pump(self) -> None:
        gen = self.client.generate(self.obj)
        try:
            async for out in gen:
                self.queue.put_nowait(out)
            self.queue.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the reader, which maps it to an HTTP error
            self.queue.put_nowait(e)
        finally:
            with anyio.CancelScope(shield=True):
                await gen.aclose()

    def abort(self, message: str) -> None:
        """End the request from outside (/abort_request): the reader gets a final 'abort' output."""
        self.queue.put_nowait(_Abort(message))

    def fail(self, error: Exception) -> None:
        """End the request from outside with an error the reader raises (the server shutting down)."""
        self.queue.put_nowait(error)

    async def next(self) -> dict | None:
        """The next output, or None after the last one. Raises the engine's error (e.g. InvalidRequestError)."""
        if self.finished:
            return None
        item = await self.queue.get()
        if item is _END:
            self._finish()
            return None
        if isinstance(item, BaseException):
            self._finish()
            raise item
        if isinstance(item, _Abort):
            item = self._abort_output(item.message)
        self._observe(item)
        self.last = item
        if item["meta_info"].get("finish_reason") is not None:
            self._finish()
        return item

    async def result(self) -> dict:
        """Wait for the end and return the final output (non-streaming requests)."""
        while (out := await self.next()) is not None:
            if self.finished:
                return out
        assert self.last is not None, "the engine ended a request without an output"
        return self.last

    async def close(self) -> None:
        """Stop the request if it is still running (the client went away): its generator, cancelled, tells the
        engine to free it, and it counts as finished with reason 'abort'."""
        if self.finished:
            self._unregister()
            return
        self._observe(self._abort_output("the client disconnected"))
        self._finish()

    def _finish(self) -> None:
        self.finished = True
        self._unregister()
        if self.task is not None and not self.task.done():
            self.task.cancel()  # after an outside abort or error the engine may still be running it

    def _unregister(self) -> None:
        # NOTE: only its own entry: a new request may hold the rid by now
        if self.registry.get(self.rid) is self:
            del self.registry[self.rid]

    # ------------------------------------------------------------------
    def _abort_output(self, message: str) -> dict:
        last = self.last or {"text": "", "output_ids": [], "meta_info": {
            "id": self.rid, "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}}
        meta = dict(last["meta_info"])
        meta["finish_reason"] = {"type": "abort", "message": message}
        meta["e2e_latency"] = time.perf_counter() - self.created
        return {"text": last["text"], "output_ids": last["output_ids"], "delta_text": "", "delta_ids": [],
                "meta_info": meta}

    def _observe(self, out: dict) -> None:
        if self.metrics is None:
            return
        now = time.perf_counter()
        if self.obj.stream and out.get("delta_ids"):
            if self._last_chunk_time is None:
                self.metrics.on_first_token(now - self.created)
            else:
                self.metrics.on_chunk_gap(now - self._last_chunk_time)
            self._last_chunk_time = now
        if out["meta_info"].get("finish_reason") is not None:
            self.metrics.on_finish(out["meta_info"], now - self.created)


async def close_all(subs: list[SubRequest]) -> None:
    for sub in subs:
        await sub.close()


async def first_outputs(subs: list[SubRequest]) -> list[dict | None]:
    """Wait for each sub-request's first output, so a bad request fails before any response is sent."""
    return list(await asyncio.gather(*(s.next() for s in subs)))


async def wait_for_disconnect(receive: Any) -> None:
    """Return when the HTTP client goes away (the body must have been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


async def until_disconnect(request: Any, coro: Any) -> Any:
    """Await `coro`, unless the client disconnects first: then cancel it and raise ClientGone."""
    main = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({main, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if main in done:
        return main.result()
    main.cancel()
    raise ClientGone()
