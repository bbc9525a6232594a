"""OpenAI-compatible endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models.

Each request becomes one engine request per prompt and choice (`n` fans out; choice i*n+j is sample j of prompt
i). Chat prompts are rendered with the model's chat template and tokenized without adding special tokens again
(the template writes BOS itself), as transformers' apply_chat_template(tokenize=True) does.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from moeserve.server.http.chat_outputs import ChatOutput, merge_fields, offered_tools
from moeserve.server.http.context import Ctx, ServerContext
from moeserve.server.http.errors import APIError, engine_error
from moeserve.server.http.protocol import (
    MAX_CHOICES,
    MAX_PROMPTS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    unsupported_sglang_field,
)
from moeserve.server.http.responses import SSE_DONE, merged, serve, sse
from moeserve.server.http.streams import SubRequest
from moeserve.server.tokenizer_manager import GenerateInput, InvalidRequestError, room_of
from moeserve.server.validation import INLINE_TEXT_CHARS
from moeserve.text.parsers.tool_calls import tool_call_ebnf

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
router = APIRouter()


# ----------------------------------------------------------------------
# request -> engine inputs
def _check_common(req: CompletionRequest | ChatCompletionRequest) -> None:
    refused = unsupported_sglang_field(req)
    if refused is not None:
        raise APIError(refused[1], 400, param=refused[0], code="unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options is only allowed with stream: true", 400, param="stream_options")
    if req.logit_bias:
        raise APIError("logit_bias is not supported", 400, param="logit_bias", code="unsupported_parameter")


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_new_tokens: int) -> dict[str, Any]:
    """SGLang sampling_params from OpenAI fields and extras (unset fields keep the engine's defaults)."""
    sp: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "stop", "stop_token_ids", "seed"):
        value = getattr(req, name)
        if value is not None:
            sp[name] = value
    if req.ignore_eos:
        sp["ignore_eos"] = True
    if not req.skip_special_tokens:
        sp["skip_special_tokens"] = False
    if req.no_stop_trim:
        sp["no_stop_trim"] = True
    for name in ("regex", "ebnf"):
        if getattr(req, name) is not None:
            sp[name] = getattr(req, name)
    if req.response_format is not None:
        schema = json_schema_of(req.response_format)
        if schema is not None:
            sp["json_schema"] = schema
    return sp


async def _check_response_format(ctx: ServerContext, req: CompletionRequest | ChatCompletionRequest,
                                 sp: dict[str, Any]) -> None:
    """A response_format the grammar backend refuses is a 400 about response_format (the engine would name
    json_schema, a field the client never sent)."""
    if req.response_format is None or "json_schema" not in sp:
        return
    try:
        await ctx.client.validator.check_grammar(("json_schema", sp["json_schema"]))
    except InvalidRequestError as e:
        raise APIError(f"response_format: {e}", 400, param="response_format") from None


def json_schema_of(response_format: dict[str, Any]) -> str | None:
    """The json_schema sampling param (a string) of OpenAI's response_format, None for plain text (SGLang's
    mapping: json_object is any JSON object)."""
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return '{"type": "object"}'
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError("response_format json_schema needs json_schema.schema, a JSON schema object", 400,
                           param="response_format")
        return json.dumps(schema)
    raise APIError(f"response_format type {kind!r} is not supported: use text, json_object or json_schema", 400,
                   param="response_format", code="unsupported_parameter")


def _fan_out(req: CompletionRequest | ChatCompletionRequest, prompts: list[tuple[str | None, list[int] | None]],
             sp_of: list[dict], request_id: str, top_logprobs_num: int, return_logprob: bool,
             logprob_start_len: int = -1) -> list[GenerateInput]:
    inputs = []
    base = req.rid or request_id
    for i, (text, ids) in enumerate(prompts):
        for j in range(req.n):
            sp = dict(sp_of[i])
            if req.n > 1 and req.seed is not None:
                sp["seed"] = req.seed + j  # n seeded samples differ from each other, reproducibly
            k = i * req.n + j
            rid = base if len(prompts) * req.n == 1 and req.rid else f"{base}-{k}"
            inputs.append(GenerateInput(text=text, input_ids=ids, sampling_params=sp, rid=rid, stream=req.stream,
                                        return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                                        logprob_start_len=logprob_start_len,
                                        bootstrap_host=req.bootstrap_host, bootstrap_port=req.bootstrap_port,
                                        bootstrap_room=room_of(req.bootstrap_room, k),
                                        data_parallel_rank=req.data_parallel_rank))
    return inputs


async def completion_inputs(ctx: ServerContext, req: CompletionRequest, request_id: str) -> list[GenerateInput]:
    _check_common(req)
    if req.echo and req.stream:
        raise APIError("echo is not supported with stream: true", 400, param="echo", code="unsupported_parameter")
    if req.max_tokens == 0 and not req.echo:
        raise APIError("max_tokens 0 needs echo: true (to score the prompt)", 400, param="max_tokens")
    if req.echo and req.logprobs is not None and ctx.client.server_args.disagg.enabled:
        # sglang-router merges prefill's prompt logprobs into /generate's meta_info only: decode's would lack them
        raise APIError("echo with logprobs is not supported by a PD pair (the router does not merge the prompt's "
                       "logprobs here); use /generate with return_logprob and logprob_start_len", 400, param="echo",
                       code="unsupported_parameter")
    if req.suffix:
        raise APIError("suffix is not supported", 400, param="suffix", code="unsupported_parameter")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError("best_of is not supported (it must be absent or equal n)", 400, param="best_of",
                       code="unsupported_parameter")
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts: list[tuple[str | None, list[int] | None]] = [(prompt, None)]
    elif not prompt:
        raise APIError("prompt is an empty list", 400, param="prompt")
    elif isinstance(prompt[0], str):
        prompts = [(p, None) for p in prompt]
    elif isinstance(prompt[0], int):
        prompts = [(None, prompt)]
    else:
        prompts = [(None, p) for p in prompt]
    for i, (text, ids) in enumerate(prompts):
        if text == "" or ids == []:
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise APIError(f"{where} is empty", 400, param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise APIError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", 400, param="prompt")
    if len(prompts) * req.n > MAX_CHOICES:
        raise APIError(f"prompts x n = {len(prompts) * req.n} exceeds {MAX_CHOICES}", 400, param="n")
    max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
    sp = sampling_params(req, max_tokens)
    await _check_response_format(ctx, req, sp)
    # echo with logprobs: the prompt's tokens are scored too (lm-evaluation-harness's log-likelihood requests)
    start = 0 if req.echo and req.logprobs is not None else -1
    return _fan_out(req, prompts, [sp] * len(prompts), request_id, req.logprobs or 0, req.logprobs is not None,
                    start)


def _message_dict(m: ChatMessage, index: int) -> dict[str, Any]:
    if isinstance(m.content, list):
        texts = []
        for part in m.content:
            if part.type != "text" or part.text is None:
                raise APIError(f"messages[{index}].content: content parts of type {part.type!r} are not supported "
                               "(this server takes text only)", 400, param=f"messages[{index}].content")
            texts.append(part.text)
        content = "".join(texts)
    else:
        content = m.content if m.content is not None else ""
    d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
    for name in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
        value = getattr(m, name)
        if value is not None:
            d[name] = value
    return d


def _check_tool_results(messages: list[dict[str, Any]]) -> None:
    """A tool message answers a call of the assistant message before it (OpenAI's rule): its tool_call_id, if
    given, names one of that message's calls."""
    calls: set[str] | None = None  # ids of the calls the tool messages from here answer (None: no calls open)
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            if calls is None:
                raise APIError(f"messages[{i}]: a message with role 'tool' must answer a preceding assistant "
                               "message with tool_calls", 400, param=f"messages[{i}]")
            if m.get("tool_call_id") is not None and calls and m["tool_call_id"] not in calls:
                raise APIError(f"messages[{i}].tool_call_id {m['tool_call_id']!r} names no call of the assistant "
                               "message before it", 400, param=f"messages[{i}].tool_call_id")
        else:
            calls = ({c.get("id") for c in m["tool_calls"]} - {None} if m.get("tool_calls") else None)


async def chat_inputs(ctx: ServerContext, req: ChatCompletionRequest, request_id: str) -> list[GenerateInput]:
    _check_common(req)
    tools = _check_tools(ctx, req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs needs logprobs: true", 400, param="top_logprobs")
    if ctx.tokenizer is None:
        raise APIError("chat completions need a tokenizer; the server runs with --skip-tokenizer-init", 400)
    messages = [_message_dict(m, i) for i, m in enumerate(req.messages)]
    _check_tool_results(messages)
    # SGLang continues the last message only when it is the assistant's; otherwise a new turn starts as usual.
    continued = req.continue_final_message and messages[-1]["role"] == "assistant"
    validator = ctx.client.validator
    try:
        # A conversation whose text alone could not fit the context is refused before it is rendered.
        validator.check_text_len(sum(len(m["content"]) for m in messages), "the conversation")
        render = functools.partial(ctx.tokenizer.apply_chat_template, messages,
                                   add_generation_prompt=not continued, continue_final_message=continued,
                                   **(req.chat_template_kwargs or {}), **({"tools": tools} if tools else {}))
        long = sum(len(m["content"]) for m in messages) > INLINE_TEXT_CHARS
        prompt = await validator.off_loop(render) if long else render()
        ids = await validator.encode(prompt, add_special_tokens=False)
    except InvalidRequestError as e:
        raise engine_error(e) from None
    except (ValueError, TypeError) as e:
        raise APIError(str(e), 400, param="messages") from None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        # OpenAI's default: as much as the context leaves (the engine rejects a prompt that fills it).
        room = ctx.context_length - len(ids)
        if ctx.kv_capacity:
            room = min(room, ctx.kv_capacity - len(ids))
        max_tokens = max(room, 1)
    sp = sampling_params(req, max_tokens)
    await _check_response_format(ctx, req, sp)
    if tools and req.tool_choice not in (None, "auto"):  # required or a named function: the grammar makes the call
        if any(k in sp for k in ("json_schema", "regex", "ebnf")):
            raise APIError(f"tool_choice {req.tool_choice!r} constrains the output to a tool call: it cannot be "
                           "combined with response_format, regex or ebnf", 400, param="tool_choice")
        sp["ebnf"] = tool_call_ebnf(ctx.client.server_args.tool_call_parser, tools)
        try:
            await ctx.client.validator.check_grammar(("ebnf", sp["ebnf"]))
        except InvalidRequestError as e:
            raise APIError(f"tool_choice {req.tool_choice!r} is enforced by the grammar backend: {e}", 400,
                           param="tool_choice") from None
    return _fan_out(req, [(None, ids)], [sp], request_id, req.top_logprobs or 0, req.logprobs)


def _check_tools(ctx: ServerContext, req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The request's tools and tool_choice checked; the tools the model is shown (None: none)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise APIError(f"tool_choice {choice!r} needs tools", 400, param="tool_choice")
        return None
    for i, tool in enumerate(req.tools):
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", 400,
                           param=f"tools[{i}]")
        if not isinstance(fn.get("parameters", {}), dict):
            raise APIError(f"tools[{i}].function.parameters must be a JSON schema object", 400, param=f"tools[{i}]")
    names = [t["function"]["name"] for t in req.tools]
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise APIError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})", 400,
                           param="tool_choice")
    elif choice not in (None, "none", "auto", "required"):
        raise APIError(f"tool_choice must be none, auto, required or a function, got {choice!r}", 400,
                       param="tool_choice")
    tools = offered_tools(req)
    if tools and ctx.client.server_args.tool_call_parser is None:
        raise APIError("tools need the server to parse the model's tool calls: start it with --tool-call-parser "
                       "(deepseekv3 for DeepSeek-V3's format)", 400, param="tools", code="unsupported_parameter")
    return tools


# ----------------------------------------------------------------------
# engine outputs -> OpenAI objects
def finish_reason(meta: dict) -> str | None:
    fr = meta.get("finish_reason")
    if fr is None:
        return None
    return fr.get("type") if isinstance(fr, dict) else str(fr)


def matched_stop(meta: dict) -> Any:
    fr = meta.get("finish_reason")
    return fr.get("matched") if isinstance(fr, dict) else None


def usage(outs: list[dict], n: int) -> dict[str, Any]:
    """Token counts of a whole request: each prompt counted once, every choice's output."""
    metas = [o["meta_info"] for o in outs]
    prompt = sum(m.get("prompt_tokens", 0) for m in metas[::n])
    cached = sum(m.get("cached_tokens", 0) for m in metas[::n])
    completion = sum(m.get("completion_tokens", 0) for m in metas)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _logprob_slice(meta: dict, start: int) -> tuple[list, list | None]:
    tokens = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs")
    return tokens[start:], (tops[start:] if tops is not None else None)


def completion_logprobs(ctx: ServerContext, meta: dict, start: int, text_offset: int, want_top: bool,
                        echo: bool = False) -> dict:
    """OpenAI's logprobs object of a completion's tokens from output position `start` on; with echo, the prompt's
    tokens first (the first one's logprob null: nothing predicts it)."""
    tokens, tops = _logprob_slice(meta, start)
    if echo:
        prompt_tops = meta.get("input_top_logprobs")
        if tops is not None or (want_top and prompt_tops is not None):
            tops = (prompt_tops or [[]] * len(meta["input_token_logprobs"])) + (tops or [])
        tokens = meta["input_token_logprobs"] + tokens
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [] if want_top else None,
                           "text_offset": []}
    offset = text_offset
    for k, (lp, tid, _) in enumerate(tokens):
        text = ctx.token_text(tid)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        out["text_offset"].append(offset)
        offset += len(text)
        if want_top:
            alts = tops[k] if tops is not None and k < len(tops) else []
            out["top_logprobs"].append({ctx.token_text(t): a for a, t, _ in alts or []})
    return out


def chat_logprobs(ctx: ServerContext, meta: dict, start: int) -> dict:
    tokens, tops = _logprob_slice(meta, start)
    content = []
    for k, (lp, tid, _) in enumerate(tokens):
        text = ctx.token_text(tid)
        alts = tops[k] if tops is not None and k < len(tops) else []
        content.append({"token": text, "logprob": lp, "bytes": list(ctx.token_bytes(tid)),
                        "top_logprobs": [{"token": ctx.token_text(t), "logprob": a, "bytes": list(ctx.token_bytes(t))}
                                         for a, t, _ in alts or []]})
    return {"content": content}


# ----------------------------------------------------------------------
# routes
@router.post("/v1/completions")
async def completions(request: Request, ctx: Ctx) -> Any:
    return await _serve(ctx, request, CompletionRequest, completion_inputs, "/v1/completions", "cmpl", chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, ctx: Ctx) -> Any:
    return await _serve(ctx, request, ChatCompletionRequest, chat_inputs, "/v1/chat/completions", "chatcmpl",
                        chat=True)


@router.get("/v1/models")
async def list_models(ctx: Ctx) -> Any:
    return {"object": "list", "data": [{
        "id": ctx.model_name, "object": "model", "created": int(time.time()), "owned_by": "moeserve",
        # root: the served name, as SGLang's is; never the server's own path (the embedded model's is the install's)
        "root": ctx.model_name, "max_model_len": ctx.context_length,
    }]}


OpenAIBody = TypeVar("OpenAIBody", CompletionRequest, ChatCompletionRequest)


async def _serve(ctx: ServerContext, request: Request, body_type: type[OpenAIBody],
                 to_inputs: Callable[[ServerContext, OpenAIBody, str], Awaitable[list[GenerateInput]]], path: str,
                 id_prefix: str, chat: bool) -> Any:
    """Read the body, check the model, fan the prompts out into engine requests, answer (streamed or not)."""
    req = await ctx.read_body(request, body_type, f"{path} request")
    ctx.check_model(req.model)
    request_id = f"{id_prefix}-{uuid.uuid4().hex}"
    inputs = await to_inputs(ctx, req, request_id)

    def respond(outs: list[dict]) -> JSONResponse:
        return JSONResponse(_response(ctx, req, outs, request_id, chat))

    def events(subs: list[SubRequest], firsts: list[dict | None]) -> AsyncIterator[str]:
        return _stream(ctx, req, subs, firsts, request_id, chat)

    try:
        return await serve(ctx, request, inputs, req.stream, respond, events)
    except APIError as e:
        if e.param != "max_new_tokens":
            raise
        # The engine's name for it; this request said max_tokens (or max_completion_tokens).
        field = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        raise APIError(e.message.replace("max_new_tokens", field), e.status, param=field, code=e.code) from None


def _prompt_texts(ctx: ServerContext, req: CompletionRequest) -> list[str]:
    """The text of each prompt of a completion request (token-id prompts detokenized), for echo."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], str):
        return list(prompt)
    batch = [prompt] if isinstance(prompt[0], int) else prompt
    if ctx.tokenizer is None:
        raise APIError("echo of token-id prompts needs a tokenizer; the server runs with --skip-tokenizer-init", 400,
                       param="echo")
    return [ctx.tokenizer.decode(ids, skip_special_tokens=False) for ids in batch]


def _response(ctx: ServerContext, req: Any, outs: list[dict], request_id: str, chat: bool) -> dict:
    choices = []
    echoed = _prompt_texts(ctx, req) if not chat and req.echo else None
    for k, out in enumerate(outs):
        meta = out["meta_info"]
        choice: dict[str, Any] = {"index": k}
        reason = finish_reason(meta)
        if chat:
            shaped = ChatOutput(ctx.client.server_args, req)
            choice["message"] = shaped.message(out["text"])
            choice["logprobs"] = chat_logprobs(ctx, meta, 0) if req.logprobs else None
            reason = shaped.finish_reason(reason)
        else:
            choice["text"] = (echoed[k // req.n] if echoed else "") + out["text"]
            choice["logprobs"] = (completion_logprobs(ctx, meta, 0, 0, req.logprobs > 0, echo=bool(echoed))
                                  if req.logprobs is not None else None)
        choice["finish_reason"] = reason
        choice["matched_stop"] = matched_stop(meta)
        choices.append(choice)
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": ctx.model_name, "choices": choices, "usage": usage(outs, req.n)}


async def _stream(ctx: ServerContext, req: Any, subs: list[SubRequest], firsts: list, request_id: str,
                  chat: bool):
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    sent_logprobs = [0] * len(subs)  # logprob entries already sent per choice
    text_offsets = [0] * len(subs)
    finals: list[dict | None] = [None] * len(subs)
    shaped = [ChatOutput(ctx.client.server_args, req) for _ in subs] if chat else []

    def chunk(choices: list[dict]) -> str:
        body: dict[str, Any] = {"id": request_id, "object": obj, "created": created, "model": ctx.model_name,
                                "choices": choices}
        if include_usage:
            body["usage"] = None
        return sse(body)

    try:
        if chat:  # the role first, as OpenAI does
            for k in range(len(subs)):
                yield chunk([{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
        async for k, out in merged(subs, firsts):
            meta = out["meta_info"]
            reason = finish_reason(meta)
            delta = out.get("delta_text", "")
            if chat:  # the delta's fields; what may be a cut marker waits for the next delta
                fields = shaped[k].feed(delta)
                if reason is not None:
                    fields = merge_fields(fields, shaped[k].finish())
                    reason = shaped[k].finish_reason(reason)
                if not fields and reason is None:
                    continue
            elif not delta and reason is None:
                continue
            logprobs = None
            if chat and req.logprobs:
                logprobs = chat_logprobs(ctx, meta, sent_logprobs[k])
            elif not chat and req.logprobs is not None:
                logprobs = completion_logprobs(ctx, meta, sent_logprobs[k], text_offsets[k], req.logprobs > 0)
            sent_logprobs[k] = len(meta.get("output_token_logprobs") or [])
            text_offsets[k] += len(delta)
            choice: dict[str, Any] = {"index": k}
            if chat:
                choice["delta"] = fields
            else:
                choice["text"] = delta
            choice["logprobs"] = logprobs
            choice["finish_reason"] = reason
            if reason is not None:
                choice["matched_stop"] = matched_stop(meta)
                finals[k] = out
            yield chunk([choice])
        if include_usage and all(f is not None for f in finals):
            yield sse({"id": request_id, "object": obj, "created": created, "model": ctx.model_name,
                       "choices": [], "usage": usage(finals, req.n)})
    except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
        yield sse(engine_error(e).body())
    yield SSE_DONE

