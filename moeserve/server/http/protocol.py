"""Request bodies of the HTTP API as pydantic models, and the limits of a request (json_body.py reads bodies).

Models are strict (no "5" for 5, no true for 1) and forbid unknown fields, as OpenAI's API does: a misspelt
`max_token` is an error that names it, not a silently ignored option. OpenAI fields that moeserve accepts but
does not act on (user, store, metadata, ...) are listed so that standard clients work; fields that would ask for
something moeserve cannot do (logit_bias, suffix, echo with stream) are checked in openai_serving.py and
refused with a message saying so. Sampling extras of SGLang and vLLM (top_k, min_p, repetition_penalty,
stop_token_ids, ignore_eos, ...) are top-level fields of the OpenAI bodies (the openai client's `extra_body`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
)

from moeserve.rank.sampling_params import SamplingParams

# The limits of a request, the same on every endpoint (json_body.py has those of the body itself).
MAX_N = 128  # most choices per prompt (n)
MAX_PROMPTS = 1024  # most prompts per request
MAX_CHOICES = 1024  # most prompts x n per request (as OpenAI's endpoints cap it)
MAX_LOGPROBS = 20  # most top logprobs per token (logprobs, top_logprobs, top_logprobs_num)

_TOKEN_IDS = TypeAdapter(list[int], config=ConfigDict(strict=True))


def _token_id_batch(value: Any) -> list[list[int]]:
    # One pydantic call per prompt, not one for the whole batch: a batch of millions of ids then never holds the
    # GIL for long (json_body.py validates large bodies in a worker thread).
    if not isinstance(value, list):
        raise ValueError("must be a list of lists of token ids")
    out = []
    for i, ids in enumerate(value):
        try:
            out.append(_TOKEN_IDS.validate_python(ids))
        except ValidationError as e:
            raise ValueError(f"entry {i}: {e.errors()[0].get('msg', 'not a list of integers')}") from None
    return out


def _sampling_params_schema() -> dict[str, Any]:
    """The JSON schema of /generate's `sampling_params` object, for /openapi.json (SGLang's names and types)."""
    schema = TypeAdapter(SamplingParams).json_schema()
    schema.pop("title", None)
    return {**schema, "additionalProperties": False}


SamplingParamsJSON = Annotated[dict[str, Any] | list[dict[str, Any]] | None, WithJsonSchema({"anyOf": [
    _sampling_params_schema(), {"type": "array", "items": _sampling_params_schema()}, {"type": "null"}]})]

TokenIdBatch = Annotated[list[list[int]], PlainValidator(_token_id_batch),
                         WithJsonSchema({"type": "array", "items": {"type": "array", "items": {"type": "integer"}}})]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _SGLangFields(_Body):
    """SGLang's own request fields that sglang-router writes into every body it forwards (with their defaults).

    The router re-serializes each request from its own typed structs, so these arrive even when the client never
    sent them. Their defaults ask for nothing moeserve lacks; a value that asks for something it cannot do is
    refused (400, unsupported_sglang_field), never ignored.
    """

    return_hidden_states: bool = False  # true: refused (moeserve returns no hidden states)


# Fields whose non-default value asks for what moeserve cannot do: name -> (the value that is refused, why).
_UNSUPPORTED_SGLANG = {
    "return_hidden_states": (True, "moeserve does not return hidden states"),
    "background": (True, "background requests are not supported; send the request and wait for its answer"),
    "return_bytes": (True, "token bytes in logprobs are not returned by /generate"),
    "return_entropy": (True, "per-token entropy is not returned"),
}


def unsupported_sglang_field(req: BaseModel) -> tuple[str, str] | None:
    """(name, message) of the first SGLang field whose value asks for what moeserve cannot do, else None."""
    for name, (refused, why) in _UNSUPPORTED_SGLANG.items():
        if getattr(req, name, None) is refused:
            return name, f"{name}: true is not supported: {why}"
    return None


# ----------------------------------------------------------------------
# SGLang native
class GenerateRequest(_SGLangFields):
    """POST /generate: one prompt or a batch (lists), as text or token ids."""

    text: str | list[str] | None = None
    input_ids: list[int] | TokenIdBatch | None = None
    sampling_params: SamplingParamsJSON = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    logprob_start_len: int | list[int] | None = None  # with return_logprob: input_token_logprobs from here
    data_parallel_rank: int | None = None  # the DP group to run in (default: the least loaded)
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None
    # Written by sglang-router into every /generate body (unsupported_sglang_field names what cannot be done):
    model: str | None = None  # accepted, unused: one model per server
    log_metrics: bool = True  # accepted: /metrics always counts every request
    no_logs: bool = False  # accepted: request bodies are never logged
    background: bool = False
    return_bytes: bool = False
    return_entropy: bool = False


class AbortRequest(_Body):
    rid: str = ""
    abort_all: bool = False


class DumpExpertDistributionRequest(_Body):
    name: str | None = None  # file name of the .pt dump in the server's dump directory (default: timestamped)


# ----------------------------------------------------------------------
# OpenAI
class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingExtras(_SGLangFields):
    """Fields of SGLang's and vLLM's OpenAI endpoints beyond OpenAI's own (`extra_body` of the openai client)."""

    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: str | None = None  # structured outputs (SGLang's): the output matches this regex
    ebnf: str | None = None  # ... or this EBNF grammar (xgrammar's dialect)
    response_format: dict[str, Any] | None = None  # ... or OpenAI's json_object / json_schema
    rid: str | None = None
    data_parallel_rank: int | None = None
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

    prompt: str | list[str] | list[int] | TokenIdBatch
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: score the prompt, generate nothing
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
    store: bool | None = None  # accepted, unused
    metadata: dict[str, Any] | None = None  # accepted, unused
    service_tier: str | None = None  # accepted, unused
    reasoning_effort: str | None = None  # accepted, unused
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template
    continue_final_message: bool = False  # continue the last (assistant) message instead of starting a new one
    # SGLang's reasoning-parser switches (sglang-router always sends them): with --reasoning-parser, the thinking
    # apart as reasoning_content (false: left in the content), streamed as it comes (false: in the last delta).
    separate_reasoning: bool = True
    stream_reasoning: bool = True
