"""The HTTP server: `build_app(client)` makes the FastAPI app, `run_server(server_args)` serves it with uvicorn.

Endpoints (docs/serving.md has the details):
- SGLang native: POST /generate, GET /health, GET /health_generate, GET /get_server_info (/server_info),
  GET /get_model_info (/model_info), GET /get_load, POST /flush_cache, POST /abort_request,
  POST /start_expert_distribution_record, /stop_expert_distribution_record, /dump_expert_distribution_record
- OpenAI: POST /v1/completions, POST /v1/chat/completions, GET /v1/models
- GET /metrics (Prometheus), GET /version
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from moeserve.eplb.recorder import expert_distribution_dir
from moeserve.server import native_serving, openai_serving
from moeserve.server.context import ServerContext, engine_error
from moeserve.server.errors import APIError, install_error_handlers
from moeserve.server.metrics import CONTENT_TYPE
from moeserve.server.protocol import AbortRequest, DumpExpertDistributionRequest, parse_body

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0
CONTROL_TIMEOUT_S = 30.0
_OPEN_PATHS = {"/health", "/metrics", "/version"}  # reachable without the API key


def server_version() -> str:
    try:
        from importlib.metadata import version

        return version("moeserve")
    except Exception:  # noqa: BLE001 - running from a source tree that is not installed
        return "0.0.0+unknown"


def build_app(client: Any) -> FastAPI:
    """The FastAPI app serving `client` (a TokenizerManager, or anything of its shape)."""
    ctx = ServerContext(client)
    api_key = getattr(client.server_args, "api_key", None)

    async def check_api_key(request: Request) -> None:
        if api_key is None or request.url.path in _OPEN_PATHS:
            return
        auth = request.headers.get("authorization", "")
        if auth != f"Bearer {api_key}":
            raise APIError("missing or wrong API key: send 'Authorization: Bearer KEY'", 401,
                           code="invalid_api_key")

    app = FastAPI(title="moeserve", version=server_version(), dependencies=[Depends(check_api_key)])
    app.state.ctx = ctx
    install_error_handlers(app)

    # ------------------------------------------------------------------ generation
    @app.post("/generate")
    async def generate(request: Request) -> Any:
        return await native_serving.generate(ctx, request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await openai_serving.completions(ctx, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await openai_serving.chat_completions(ctx, request)

    @app.get("/v1/models")
    async def models() -> Any:
        return openai_serving.list_models(ctx)

    # ------------------------------------------------------------------ health and info
    @app.get("/health")
    async def health() -> Any:
        if not client.healthy:
            raise APIError(f"unhealthy: {client.dead_reason or 'the engine is not running'}", 503,
                           code="engine_dead")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Any:
        """Generate one token end to end: proves the workers step, not only that the process lives."""
        if not client.healthy:
            raise APIError(f"unhealthy: {client.dead_reason or 'the engine is not running'}", 503,
                           code="engine_dead")
        from moeserve.server.tokenizer_manager import GenerateInput

        bos = getattr(client.tokenizer, "bos_token_id", None) if client.tokenizer is not None else None
        obj = GenerateInput(input_ids=[bos if bos is not None else 0],
                            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                            rid=f"health-{uuid.uuid4().hex}")
        gen = client.generate(obj)

        async def run() -> None:
            async for _ in gen:
                pass

        try:
            await asyncio.wait_for(run(), HEALTH_GENERATE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001
            raise APIError(f"unhealthy: one-token generation failed: {type(e).__name__}: {e}", 503,
                           code="engine_dead") from None
        finally:
            await gen.aclose()
        return Response(status_code=200)

    def server_info() -> dict:
        info = dataclasses.asdict(client.server_args) if dataclasses.is_dataclass(client.server_args) else {}
        info.update({
            "version": server_version(),
            "served_model_name": ctx.model_name,
            "context_length": ctx.context_length,
            "max_total_tokens": ctx.kv_capacity,
            "internal_states": [_as_dict(x) for x in client.last_load],
        })
        return info

    @app.get("/get_server_info")
    async def get_server_info() -> Any:
        return server_info()

    @app.get("/server_info")
    async def server_info_route() -> Any:
        return server_info()

    def model_info() -> dict:
        args = client.server_args
        cfg = getattr(client, "model_config", None)
        return {
            "model_path": args.model_path,
            "tokenizer_path": None if client.tokenizer is None else (args.tokenizer_path or args.model_path),
            "is_generation": True,
            "served_model_name": ctx.model_name,
            "architecture": getattr(cfg, "architecture", None),
            "context_length": ctx.context_length,
            "vocab_size": getattr(cfg, "vocab_size", None),
        }

    @app.get("/get_model_info")
    async def get_model_info() -> Any:
        return model_info()

    @app.get("/model_info")
    async def model_info_route() -> Any:
        return model_info()

    @app.get("/version")
    async def version() -> Any:
        return {"version": server_version()}

    # ------------------------------------------------------------------ control
    @app.get("/get_load")
    async def get_load() -> Any:
        try:
            loads = await asyncio.wait_for(client.get_load(), CONTROL_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001
            raise engine_error(e) from None
        return [_as_dict(x) for x in loads]

    @app.api_route("/flush_cache", methods=["POST", "GET"])
    async def flush_cache() -> Any:
        try:
            ok = await asyncio.wait_for(client.flush_cache(), CONTROL_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001
            raise engine_error(e) from None
        if ok:
            return {"success": True, "message": "Cache flushed."}
        return JSONResponse({"success": False, "message": "Cache not flushed: requests are running; retry when "
                             "the server is idle."}, status_code=400)

    # expert-distribution recording (--expert-distribution-recorder-mode stat), SGLang's three endpoints
    async def expert_distribution(call) -> Any:
        try:
            return await asyncio.wait_for(call, CONTROL_TIMEOUT_S)
        except ValueError as e:
            raise APIError(str(e), 400) from None
        except Exception as e:  # noqa: BLE001
            raise engine_error(e) from None

    @app.api_route("/start_expert_distribution_record", methods=["POST", "GET"])
    async def start_expert_distribution_record() -> Any:
        await expert_distribution(client.expert_distribution("start"))
        return {"success": True, "message": "Expert distribution recording started."}

    @app.api_route("/stop_expert_distribution_record", methods=["POST", "GET"])
    async def stop_expert_distribution_record() -> Any:
        await expert_distribution(client.expert_distribution("stop"))
        return {"success": True, "message": "Expert distribution recording stopped."}

    @app.api_route("/dump_expert_distribution_record", methods=["POST", "GET"])
    async def dump_expert_distribution_record(request: Request) -> Any:
        body = await request.body()
        path = None
        if body:
            req = parse_body(body, DumpExpertDistributionRequest, "/dump_expert_distribution_record request")
            if req.name is not None:  # a plain file name: an HTTP client does not choose where the server writes
                if not req.name or Path(req.name).name != req.name or req.name.startswith("."):
                    raise APIError(f"name {req.name!r}: give a plain file name, no directories", 400, param="name")
                path = str(expert_distribution_dir() / req.name)
        return {"success": True, **await expert_distribution(client.dump_expert_distribution(path))}

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Any:
        req = parse_body(await request.body(), AbortRequest, "/abort_request request")
        if not req.rid and not req.abort_all:
            raise APIError("give the rid of the request to abort, or abort_all: true", 400, param="rid")
        rids = list(ctx.inflight) if req.abort_all else [req.rid]
        aborted = []
        for rid in rids:
            sub = ctx.inflight.get(rid)
            try:
                await client.abort(rid)
            except Exception as e:  # noqa: BLE001
                raise engine_error(e) from None
            if sub is not None:
                sub.abort("aborted by /abort_request")
                aborted.append(rid)
        return {"aborted": aborted}

    # ------------------------------------------------------------------ metrics
    @app.get("/metrics")
    async def metrics() -> Any:
        return Response(ctx.metrics.render(list(client.last_load)), media_type=CONTENT_TYPE)

    return app


def _as_dict(x: Any) -> Any:
    return dataclasses.asdict(x) if dataclasses.is_dataclass(x) else x


# ----------------------------------------------------------------------
def run_server(server_args: Any) -> None:
    """Start the engine, serve HTTP until SIGINT/SIGTERM, then stop the engine (no orphan workers)."""
    from moeserve.server.tokenizer_manager import TokenizerManager

    # NOTE: SIGTERM must unwind the stack (SystemExit), not kill the process, so that the workers are stopped.
    previous = _raise_on_sigterm()
    client = None
    try:
        client = TokenizerManager(server_args)
        app = build_app(client)
        config = uvicorn.Config(app, host=server_args.host, port=server_args.port,
                                log_level=getattr(server_args, "log_level", "info"), access_log=False,
                                timeout_keep_alive=30, timeout_graceful_shutdown=5, lifespan="off")
        server = _Server(config)
        server.moeserve_ctx = app.state.ctx
        server.run()
    except (KeyboardInterrupt, SystemExit):
        logger.info("interrupted; shutting down")
    finally:
        if client is not None:
            client.shutdown()
        logger.info("moeserve stopped")
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _raise_on_sigterm() -> Any:
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, handler)


class _Server(uvicorn.Server):
    """uvicorn's Server, logging moeserve's URL once listening and not re-raising the stop signal."""

    moeserve_ctx: ServerContext | None = None

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            host = self.config.host if ":" not in self.config.host else f"[{self.config.host}]"
            name = self.moeserve_ctx.model_name if self.moeserve_ctx else "?"
            logger.info("moeserve serving %s at http://%s:%d (OpenAI API under /v1)", name, host, self.config.port)

    async def shutdown(self, sockets: Any = None) -> None:
        # End the requests in flight (finish reason 'abort') so that their responses complete at once instead
        # of being cut when the graceful-shutdown timeout runs out.
        if self.moeserve_ctx is not None and self.moeserve_ctx.inflight:
            logger.info("shutting down: aborting %d requests in flight", len(self.moeserve_ctx.inflight))
            for sub in list(self.moeserve_ctx.inflight.values()):
                sub.abort("the server is shutting down")
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises SIGINT/SIGTERM after its graceful stop; run_server stops the engine instead.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
