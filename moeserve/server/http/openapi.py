"""The server's OpenAPI document (GET /openapi.json): every request body and the error responses.

The routes read their bodies themselves (json_body.py: size, depth and Unicode limits, large bodies off the event
loop), so FastAPI sees no body parameter and would document none; `openapi_document` adds each POST body's
pydantic schema, and to every operation the error statuses it can answer, all in the one error shape
`{"error": {"message", "type", "param", "code"}}` (errors.py).
"""

from __future__ import annotations

import warnings
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from moeserve.server.http.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DumpExpertDistributionRequest,
    GenerateRequest,
)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """Every error the server answers, whatever its status."""

    error: ErrorDetail


# path -> (body model, whether the body is required)
BODIES: dict[str, tuple[type[BaseModel], bool]] = {
    "/generate": (GenerateRequest, True),
    "/v1/completions": (CompletionRequest, True),
    "/v1/chat/completions": (ChatCompletionRequest, True),
    "/abort_request": (AbortRequest, True),
    "/dump_expert_distribution_record": (DumpExpertDistributionRequest, False),
}
GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
# reachable without the API key, as SGLang's (load balancers and Prometheus); --api-key-all-routes closes them too
OPEN_PATHS = frozenset({"/health", "/metrics"})

_ERRORS = {
    400: "The request is malformed or cannot be served (the message names the field).",
    401: "Missing or wrong API key (with --api-key).",
    404: "No such model (OpenAI endpoints) or endpoint.",
    413: "The body is larger than the server takes.",
    500: "The engine could not finish the request (the model's logits were not finite).",
    503: "The engine is not running, the server is overloaded (--max-concurrent-requests) or shutting down.",
}


def _error_statuses(path: str, method: str) -> list[int]:
    statuses = [400, 401, 404, 413, 503] if method == "post" else [401, 404, 503]
    if path in OPEN_PATHS:
        statuses.remove(401)
    if path in GENERATION_PATHS:
        statuses.append(500)
    return sorted(statuses)


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """app.openapi: FastAPI's document plus the request bodies and error responses (built once)."""
    if app.openapi_schema:
        return app.openapi_schema
    with warnings.catch_warnings():  # routes with two methods share FastAPI's operation id; named below
        warnings.simplefilter("ignore", UserWarning)
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                          description="OpenAI- and SGLang-compatible API of moeserve (docs/serving.md).")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for model in [ErrorResponse, *(m for m, _ in BODIES.values())]:
        js = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(js.pop("$defs", {}))
        schemas[model.__name__] = js
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    for path, ops in doc.get("paths", {}).items():
        for method, op in ops.items():
            op["operationId"] = f"{method}{path}".replace("/", "_")
            if method == "post" and path in BODIES:
                model, required = BODIES[path]
                op["requestBody"] = {"required": required, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            responses = op.setdefault("responses", {})
            responses.pop("422", None)  # FastAPI's validation error: this server answers 400
            for status in _error_statuses(path, method):
                responses[str(status)] = {"description": _ERRORS[status], **error}
    app.openapi_schema = doc
    return doc
