"""ServerContext: what every endpoint needs (the engine client, its metrics, the live requests), and the
FastAPI dependency `Ctx` that hands it to a route."""

from __future__ import annotations

from typing import Annotated, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel

from moeserve.server.http.errors import APIError, engine_error
from moeserve.server.http.json_body import MAX_BODY_BYTES, read_body, receive_body
from moeserve.server.http.metrics import Metrics
from moeserve.server.http.protocol import MAX_PROMPTS
from moeserve.server.http.serving_client import ServingClient
from moeserve.server.http.streams import SubRequest
from moeserve.server.rank_client import EngineDeadError
from moeserve.server.tokenizer_manager import DEFAULT_MODEL_NAME, GenerateInput
from moeserve.text.tokenizer import Tokenizer

BodyT = TypeVar("BodyT", bound=BaseModel)


class ServerContext:
    """The state of one HTTP server around its engine client (a TokenizerManager)."""

    def __init__(self, client: ServingClient, metrics: Metrics):
        self.client = client
        self.model_name: str = client.model_name
        self.api_key: str | None = client.server_args.api_key
        self.metrics = metrics
        self.inflight: dict[str, SubRequest] = {}  # rid -> live sub-request, for /abort_request
        self.num_http_requests = 0  # generation requests being served, for max_concurrent_requests
        self.max_concurrent_requests: int = client.server_args.max_concurrent_requests or 0
        self.draining = False  # the server is stopping: new requests get 503 (server.py)
        self._token_text: dict[int, str] = {}

    # ------------------------------------------------------------------ model facts
    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.client.tokenizer

    @property
    def context_length(self) -> int:
        return self.client.context_length or self.client.model_config.context_length

    @property
    def kv_capacity(self) -> int:
        """Most tokens one request can hold in the KV cache."""
        return self.client.max_total_tokens

    @property
    def max_entries(self) -> int:
        """Most entries of any array or object in a request body: no request needs more (json_body.py)."""
        return max(self.context_length, MAX_PROMPTS, self.client.model_config.vocab_size)

    @property
    def max_string_bytes(self) -> int:
        """Longest string a large request body may hold (json_body.py): the longest prompt the context can hold."""
        return self.client.validator.max_prompt_chars or MAX_BODY_BYTES

    @property
    def model_names(self) -> set[str]:
        names = {self.model_name, DEFAULT_MODEL_NAME}  # and the model's path, the name before --served-model-name
        if self.client.server_args.model_path:
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
        return tok.token_bytes(token_id)

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
    async def read_body(self, request: Request, model: type[BodyT], what: str, required: bool = True
                        ) -> BodyT | None:
        """The request's body parsed and validated into `model` within this server's limits (json_body.py); None
        for an empty body that is not `required`."""
        raw = await receive_body(request)
        if not raw and not required:
            return None
        try:
            return await read_body(raw, model, what, self.max_entries, self.max_string_bytes)
        except APIError as e:
            if e.code != "context_length_exceeded":
                raise
            # json_body.py measures bytes and knows no context; the client thinks in tokens.
            raise APIError(f"the request body holds a string longer than any prompt the context length of "
                           f"{self.context_length} tokens allows; it was not parsed", e.status, code=e.code) from None

    def new_sub(self, obj: GenerateInput) -> SubRequest:
        if obj.rid in self.inflight:
            raise APIError(f"request id {obj.rid!r} is already in use", 400, param="rid", code="duplicate_rid")
        return SubRequest(self.client, obj, self.metrics, self.inflight)

    def fail_inflight(self, message: str) -> None:
        """End every live request with a 503 error (the server is shutting down)."""
        for sub in list(self.inflight.values()):
            sub.fail(APIError(message, 503, code="shutting_down"))

    def enter(self) -> None:
        if self.draining:
            raise APIError("the server is shutting down and takes no new requests; retry on another replica", 503,
                           code="shutting_down")
        if self.max_concurrent_requests and self.num_http_requests >= self.max_concurrent_requests:
            pd = self.client.server_args.disagg.enabled  # behind sglang-router: 429 is "try later"
            raise APIError(f"the server is serving {self.num_http_requests} requests, its limit "
                           "(--max-concurrent-requests); retry later", 429 if pd else 503, code="overloaded")
        if not self.client.healthy:
            raise engine_error(EngineDeadError(self.client.dead_reason or "the engine is not running"))
        self.num_http_requests += 1

    def leave(self) -> None:
        self.num_http_requests -= 1


async def server_context(request: Request) -> ServerContext:
    """The ServerContext of the app that serves `request` (build_app puts it in app.state). A coroutine: FastAPI
    runs a plain function dependency in its thread pool, a thread hop per request for an attribute read."""
    return request.app.state.ctx


Ctx = Annotated[ServerContext, Depends(server_context)]  # a route's `ctx: Ctx` parameter
