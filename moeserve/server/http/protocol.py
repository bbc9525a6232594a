"""Request bodies of the HTTP API as pydantic models, and the JSON reading in front of them.

Models are strict (no "5" for 5, no true for 1) and forbid unknown fields, as OpenAI's API does: a misspelt
`max_token` is an error that names it, not a silently ignored option. OpenAI fields that moeserve accepts but
does not act on (user, store, metadata, ...) are listed so that standard clients work; fields that would ask for
something moeserve cannot do (tools, logit_bias, echo, suffix, JSON mode) are checked in openai_serving.py and
refused with a message saying so. Sampling extras of SGLang and vLLM (top_k, min_p, repetition_penalty,
stop_token_ids, ignore_eos, ...) are top-level fields of the OpenAI bodies (the openai client's `extra_body`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moeserve.server.http.errors import APIError, validation_message

MAX_N = 128  # most choices per request (n), and most prompts per batch request
MAX_LOGPROBS = 20
MAX_BODY_BYTES = 64 * 1024 * 1024


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# ----------------------------------------------------------------------
# SGLang native
class GenerateRequest(_Body):
    """POST /generate: one prompt or a batch (lists), as text or token ids."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    logprob_start_len: int | list[int] | None = None  # accepted for SGLang clients; output logprobs only
    data_parallel_rank: int | None = None  # accepted for SGLang clients; the server picks the DP group
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None


class AbortRequest(_Body):
    rid: str = ""
    abort_all: bool = False


class DumpExpertDistributionRequest(_Body):
    name: str | None = None  # file name of the .pt dump in the server's dump directory (default: timestamped)


# ----------------------------------------------------------------------
# OpenAI
class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingExtras(_Body):
    """Fields of SGLang's and vLLM's OpenAI endpoints beyond OpenAI's own (`extra_body` of the openai client)."""

    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    rid: str | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


class _OpenAICommon(_SamplingExtras):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted, unused


class CompletionRequest(_OpenAICommon):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_OpenAICommon):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # accepted, unused
    response_format: dict[str, Any] | None = None
    store: bool | None = None  # accepted, unused
    metadata: dict[str, Any] | None = None  # accepted, unused
    service_tier: str | None = None  # accepted, unused
    reasoning_effort: str | None = None  # accepted, unused
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template


# ----------------------------------------------------------------------
# reading bodies
def parse_json(raw: bytes) -> Any:
    """The JSON value of a request body; APIError (400) for bad UTF-8, bad JSON, NaN, lone surrogates."""
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(f"the request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}", 413)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(f"the request body is not valid UTF-8 (bad byte at offset {e.start})", 400,
                       code="invalid_utf8") from None
    if not text.strip():
        raise APIError("the request body is empty; send a JSON object", 400, code="invalid_json")
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise APIError(f"the request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})", 400,
                       code="invalid_json") from None
    except ValueError as e:
        raise APIError(str(e), 400, code="invalid_json") from None
    _check_strings(value, "")
    return value


def parse_body(raw: bytes, model: type[BaseModel], what: str) -> Any:
    """Parse and validate a body into `model`; every problem becomes a 400 naming the field."""
    value = parse_json(raw)
    if not isinstance(value, dict):
        raise APIError(f"the request body must be a JSON object, got {type(value).__name__}", 400,
                       code="invalid_json")
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise validation_message(e, what) from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"the request body holds {name}, which is not valid JSON")


def _check_strings(value: Any, path: str) -> None:
    # JSON escapes can encode lone UTF-16 surrogates ("\ud800"), which no tokenizer can take.
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(f"{path or 'the body'}: the string holds an unpaired UTF-16 surrogate "
                           "(invalid Unicode)", 400, param=path or None, code="invalid_unicode") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, path)
            _check_strings(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_strings(v, f"{path}[{i}]")
