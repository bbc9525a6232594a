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

from fastapi import Depends, FastAPI, Request

from moeserve.server.http import control, info, native_serving, openai_serving
from moeserve.server.http.context import Ctx, ServerContext
from moeserve.server.http.errors import APIError, install_error_handlers
from moeserve.server.http.metrics import Metrics
from moeserve.server.http.openapi import OPEN_PATHS, openapi_document
from moeserve.server.http.serving_client import ServingClient


async def check_api_key(request: Request, ctx: Ctx) -> None:
    """With --api-key, every endpoint but the open ones asks for 'Authorization: Bearer KEY'."""
    if ctx.api_key is None or request.url.path in OPEN_PATHS:
        return
    auth = request.headers.get("authorization", "")
    if auth != f"Bearer {ctx.api_key}":
        raise APIError("missing or wrong API key: send 'Authorization: Bearer KEY'", 401,
                       code="invalid_api_key")


def build_app(client: ServingClient) -> FastAPI:
    """The FastAPI app serving `client` (a TokenizerManager, or anything of its shape)."""
    app = FastAPI(title="moeserve", version=info.server_version(), dependencies=[Depends(check_api_key)])
    app.state.ctx = ServerContext(client, Metrics(client.model_name))
    install_error_handlers(app)
    for module in (native_serving, openai_serving, info, control):
        app.include_router(module.router)
    app.openapi = lambda: openapi_document(app)  # type: ignore[method-assign]
    return app
