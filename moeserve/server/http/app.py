"""The HTTP app: `build_app(client)` assembles the FastAPI app from the routers of the endpoint modules.

Endpoints (docs/serving.md has the details):
- SGLang native (native_serving.py): POST /generate
- OpenAI (openai_serving.py): POST /v1/completions, POST /v1/chat/completions, GET /v1/models
- health and info (info.py): GET /health, /health_generate, /get_server_info (/server_info),
  /get_model_info (/model_info), /version, /metrics (Prometheus; the collectors in metrics.py)
- control (control.py): GET /get_load, POST /flush_cache, POST /abort_request,
  POST /start_expert_distribution_record, /stop_expert_distribution_record, /dump_expert_distribution_record

server.py serves the app with uvicorn (`run_server`).
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI

from moeserve.server.http import control, info, native_serving, openai_serving
from moeserve.server.http.context import ServerContext
from moeserve.server.http.errors import APIError, error_response, install_error_handlers
from moeserve.server.http.metrics import Metrics
from moeserve.server.http.openapi import OPEN_PATHS, openapi_document
from moeserve.server.http.serving_client import ServingClient


class APIKeyGuard:
    """ASGI middleware: with --api-key, every path (FastAPI's /docs, /redoc and /openapi.json included) but
    `open_paths` asks for 'Authorization: Bearer KEY'."""

    def __init__(self, app: Any, key: str, open_paths: frozenset[str]):
        self.app, self.expected, self.open_paths = app, f"Bearer {key}".encode(), open_paths

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = APIError("missing or wrong API key: send 'Authorization: Bearer KEY'", 401,
                               code="invalid_api_key")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(client: ServingClient) -> FastAPI:
    """The FastAPI app serving `client` (a TokenizerManager, or anything of its shape)."""
    app = FastAPI(title="moeserve", version=info.server_version())
    app.state.ctx = ServerContext(client, Metrics(client.model_name))
    args = client.server_args
    if args.api_key is not None:
        app.add_middleware(APIKeyGuard, key=args.api_key,
                           open_paths=frozenset() if args.api_key_all_routes else OPEN_PATHS)
    install_error_handlers(app)
    for module in (native_serving, openai_serving, info, control):
        app.include_router(module.router)
    app.openapi = lambda: openapi_document(app)  # type: ignore[method-assign]
    return app
