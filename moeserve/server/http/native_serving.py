"""POST /generate: SGLang's native generation endpoint (one prompt or a batch, streamed or not).

A single prompt answers one object `{text, output_ids, meta_info}`; a batch (a list of texts or of id lists) or
`sampling_params.n > 1` answers a list, in prompt-major order (prompt i, sample j at i * n + j). Streaming sends
`data: {...}` events with the cumulative text and ids (as SGLang does; plus `index` for batches) and ends with
`data: [DONE]`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from moeserve.server.http.context import Ctx, ServerContext
from moeserve.server.http.errors import APIError, engine_error
from moeserve.server.http.protocol import (
    MAX_CHOICES,
    MAX_N,
    MAX_PROMPTS,
    GenerateRequest,
    unsupported_sglang_field,
)
from moeserve.server.http.responses import SSE_DONE, merged, serve, sse
from moeserve.server.http.streams import SubRequest
from moeserve.server.tokenizer_manager import GenerateInput, room_of

router = APIRouter()


def _per_item(value: Any, name: str, batch: int | None) -> list:
    """A field given once (applies to every prompt) or as a list with one entry per prompt."""
    if isinstance(value, list):
        if batch is None:
            raise APIError(f"{name} is a list, but the request has one prompt", 400, param=name)
        if len(value) != batch:
            raise APIError(f"{name} has {len(value)} entries for {batch} prompts", 400, param=name)
        return value
    return [value] * (batch or 1)


def build_inputs(req: GenerateRequest) -> tuple[list[GenerateInput], bool]:
    """GenerateInputs of a /generate body (n expanded), and whether the answer is a list."""
    refused = unsupported_sglang_field(req)
    if refused is not None:
        raise APIError(refused[1], 400, param=refused[0], code="unsupported_parameter")
    if req.text is not None and req.input_ids is not None:
        raise APIError("give either text or input_ids, not both", 400, param="input_ids")
    if req.text is None and req.input_ids is None:
        raise APIError("give the prompt as text or input_ids", 400, param="text")
    if req.text is not None:
        batch = len(req.text) if isinstance(req.text, list) else None
        prompts: list[tuple[str | None, list[int] | None]] = [(t, None) for t in
                                                              (req.text if batch is not None else [req.text])]
    else:
        ids = req.input_ids
        batch = len(ids) if ids and isinstance(ids[0], list) else None
        prompts = [(None, p) for p in (ids if batch is not None else [ids])]
    if batch is not None and not 1 <= batch <= MAX_PROMPTS:
        raise APIError(f"a batch holds 1 to {MAX_PROMPTS} prompts, got {batch}", 400,
                       param="text" if req.text is not None else "input_ids")

    for i, (text, ids) in enumerate(prompts):
        if text == "" or ids == []:
            field = "text" if req.text is not None else "input_ids"
            raise APIError(f"{field if batch is None else f'{field}[{i}]'} is empty: the prompt needs at least one "
                           "token", 400, param=field)
    params = _per_item(req.sampling_params, "sampling_params", batch)
    rids = _per_item(req.rid, "rid", batch)
    logprob = _per_item(req.return_logprob, "return_logprob", batch)
    top_n = _per_item(req.top_logprobs_num, "top_logprobs_num", batch)
    starts = _per_item(req.logprob_start_len, "logprob_start_len", batch)
    hosts = _per_item(req.bootstrap_host, "bootstrap_host", batch)
    ports = _per_item(req.bootstrap_port, "bootstrap_port", batch)
    rooms = _per_item(req.bootstrap_room, "bootstrap_room", batch)
    given = [r for r in rids if r is not None]
    if len(set(given)) != len(given):
        raise APIError("rid values must be unique within a batch", 400, param="rid")

    ns = [_n_of(sp) for sp in params]
    if sum(ns) > MAX_CHOICES:
        raise APIError(f"prompts x n = {sum(ns)} exceeds {MAX_CHOICES}", 400, param="sampling_params.n")
    inputs: list[GenerateInput] = []
    many = batch is not None
    for i, (text, ids) in enumerate(prompts):
        sp = dict(params[i] or {})
        sp.pop("n", None)
        n = ns[i]
        many = many or n > 1
        base = rids[i] or uuid.uuid4().hex
        for j in range(n):
            spj = dict(sp)
            if n > 1 and isinstance(sp.get("seed"), int):
                spj["seed"] = sp["seed"] + j  # n samples of one seeded request differ, reproducibly
            rid = base if n == 1 else f"{base}-{j}"
            inputs.append(GenerateInput(text=text, input_ids=ids, sampling_params=spj, rid=rid, stream=req.stream,
                                        return_logprob=logprob[i], top_logprobs_num=top_n[i],
                                        logprob_start_len=-1 if starts[i] is None else starts[i],
                                        bootstrap_host=hosts[i], bootstrap_port=ports[i],
                                        bootstrap_room=room_of(rooms[i], j),
                                        data_parallel_rank=req.data_parallel_rank))
    return inputs, many


def _n_of(sampling_params: dict | None) -> int:
    n = (sampling_params or {}).get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise APIError(f"sampling_params.n must be an integer in [1, {MAX_N}], got {n!r}", 400,
                       param="sampling_params.n")
    return n


def format_output(ctx: ServerContext, out: dict, return_text_in_logprobs: bool, index: int | None) -> dict:
    meta = out["meta_info"]
    if return_text_in_logprobs:
        meta = dict(meta)
        for side in ("input", "output"):
            if f"{side}_token_logprobs" in meta:
                meta[f"{side}_token_logprobs"] = [(lp, t, ctx.token_text(t))
                                                  for lp, t, _ in meta[f"{side}_token_logprobs"]]
            if f"{side}_top_logprobs" in meta:
                meta[f"{side}_top_logprobs"] = [[(lp, t, ctx.token_text(t)) for lp, t, _ in alts] if alts else alts
                                                for alts in meta[f"{side}_top_logprobs"]]
    result = {"text": out["text"], "output_ids": out["output_ids"], "meta_info": meta}
    if index is not None:
        result["index"] = index
    return result


@router.post("/generate")
async def generate(request: Request, ctx: Ctx) -> Any:
    req = await ctx.read_body(request, GenerateRequest, "/generate request")
    logprob = any(req.return_logprob) if isinstance(req.return_logprob, list) else req.return_logprob
    if req.stream and logprob and ctx.client.server_args.disagg.is_prefill:
        # the router's only reader: sglang-router reads a streamed request's prefill answer whole, as one JSON
        # object, for the input_token_logprobs it prepends to decode's chunks (prefill answers once anyway)
        req = req.model_copy(update={"stream": False})
    inputs, many = build_inputs(req)

    def respond(outs: list[dict]) -> JSONResponse:
        results = [format_output(ctx, o, req.return_text_in_logprobs, None) for o in outs]
        return JSONResponse(results if many else results[0])

    async def events(subs: list[SubRequest], firsts: list[dict | None]) -> AsyncIterator[str]:
        try:
            async for i, out in merged(subs, firsts):
                yield sse(format_output(ctx, out, req.return_text_in_logprobs, i if many else None))
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
            yield sse(engine_error(e).body())
        yield SSE_DONE

    return await serve(ctx, request, inputs, req.stream, respond, events)
