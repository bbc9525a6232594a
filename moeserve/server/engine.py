"""Engine: the offline API. `Engine(model_path=..., **server_args).generate(prompts, sampling_params)`.

It runs the server's own TokenizerManager (started by startup.py, as the HTTP server's is; with the DP
controller and the rank client behind it) on a private asyncio loop in a background thread, so plain synchronous code can call it, and
exposes `async_generate` for asyncio code (streaming or not).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from moeserve.args import ServerArgs
from moeserve.server.startup import start_engine
from moeserve.server.tokenizer_manager import GenerateInput


class Engine:
    """Offline inference engine over the same workers a server uses."""

    def __init__(self, model_path: str | None = None, **kwargs: Any):
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="moeserve-engine", daemon=True)
        self._thread.start()
        self.client = start_engine(self.server_args)
        self.tokenizer = self.client.tokenizer

    # ------------------------------------------------------------------
    @staticmethod
    def _inputs(prompt, input_ids, sampling_params, return_logprob, top_logprobs_num, stream, rid,
                logprob_start_len: int = -1) -> tuple[list[GenerateInput], bool]:
        batched = isinstance(prompt, list) or (input_ids is not None and input_ids and isinstance(input_ids[0], list))
        prompts = prompt if isinstance(prompt, list) else [prompt]
        if input_ids is not None:
            ids_list = input_ids if batched else [input_ids]
            prompts = [None] * len(ids_list)
        else:
            ids_list = [None] * len(prompts)
        n = len(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        rids = rid if isinstance(rid, list) else [rid] * n
        if len(params) != n or len(rids) != n:
            raise ValueError(f"{n} prompts but {len(params)} sampling_params and {len(rids)} rids")
        objs = [GenerateInput(text=t, input_ids=i, sampling_params=p, rid=r, stream=stream,
                              return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                              logprob_start_len=logprob_start_len)
                for t, i, p, r in zip(prompts, ids_list, params, rids, strict=True)]
        return objs, batched

    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool = False,
                 top_logprobs_num: int = 0, stream: bool = False, rid: str | list[str] | None = None,
                 logprob_start_len: int = -1, data_parallel_rank: int | list[int | None] | None = None):
        """Generate for one prompt (returns a dict) or a list (returns a list of dicts, in order).
        data_parallel_rank: the DP group to run in (default: the least loaded), one for all or one per prompt.

        With stream=True (one prompt), returns an iterator of output chunks. With return_logprob and
        logprob_start_len >= 0, meta_info also holds the prompt's input_token_logprobs from that position.
        """
        objs, batched = self._inputs(prompt, input_ids, sampling_params, return_logprob, top_logprobs_num,
                                     stream, rid, logprob_start_len)
        groups = data_parallel_rank if isinstance(data_parallel_rank, list) else [data_parallel_rank] * len(objs)
        if len(groups) != len(objs):
            raise ValueError(f"{len(objs)} prompts but {len(groups)} data_parallel_rank values")
        for obj, group in zip(objs, groups, strict=True):
            obj.data_parallel_rank = group
        if stream:
            if batched:
                raise ValueError("stream=True takes one prompt")
            return self._stream_sync(objs[0])

        async def run_all():
            return await asyncio.gather(*(self._collect(o) for o in objs))

        outs = asyncio.run_coroutine_threadsafe(run_all(), self._loop).result()
        return outs if batched else outs[0]

    async def _collect(self, obj: GenerateInput) -> dict:
        last = None
        async for out in self.client.generate(obj):
            last = out
        assert last is not None
        return last

    def _stream_sync(self, obj: GenerateInput) -> Iterator[dict]:
        agen = self.client.generate(obj)
        while True:
            try:
                yield asyncio.run_coroutine_threadsafe(agen.__anext__(), self._loop).result()
            except StopAsyncIteration:
                return

    async def async_generate(self, prompt: str | None = None, sampling_params: dict | None = None,
                             input_ids: list[int] | None = None, return_logprob: bool = False,
                             top_logprobs_num: int = 0, stream: bool = False,
                             rid: str | None = None, logprob_start_len: int = -1) -> dict | AsyncIterator[dict]:
        """From asyncio code: a dict, or with stream=True an async iterator of chunks."""
        obj = GenerateInput(text=prompt, input_ids=input_ids, sampling_params=sampling_params, rid=rid,
                            stream=stream, return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                            logprob_start_len=logprob_start_len)
        if stream:
            return self._stream_async(obj)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._collect(obj), self._loop))

    async def _stream_async(self, obj: GenerateInput) -> AsyncIterator[dict]:
        agen = self.client.generate(obj)
        while True:
            try:
                fut = asyncio.run_coroutine_threadsafe(agen.__anext__(), self._loop)
                yield await asyncio.wrap_future(fut)
            except StopAsyncIteration:
                return

    def flush_cache(self) -> bool:
        return asyncio.run_coroutine_threadsafe(self.client.flush_cache(), self._loop).result()

    def get_load(self):
        return asyncio.run_coroutine_threadsafe(self.client.get_load(), self._loop).result()

    # Expert-distribution recording (--expert-distribution-recorder-mode stat; moeserve/eplb/recorder.py)
    def start_expert_distribution_record(self) -> None:
        asyncio.run_coroutine_threadsafe(self.client.expert_distribution("start"), self._loop).result()

    def stop_expert_distribution_record(self) -> None:
        asyncio.run_coroutine_threadsafe(self.client.expert_distribution("stop"), self._loop).result()

    def dump_expert_distribution_record(self, path: str | None = None) -> dict:
        """Write the recorded window to `path` (default: under $MOESERVE_CACHE); its path and totals."""
        return asyncio.run_coroutine_threadsafe(self.client.dump_expert_distribution(path), self._loop).result()

    def shutdown(self) -> None:
        self.client.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
