"""Health and information endpoints: GET /health, /health_generate, /get_server_info (/server_info),
/get_model_info (/model_info), /version, /metrics (Prometheus)."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from moeserve.server.http.context import Ctx, ServerContext
from moeserve.server.http.errors import APIError
from moeserve.server.http.metrics import CONTENT_TYPE
from moeserve.server.tokenizer_manager import GenerateInput

HEALTH_GENERATE_TIMEOUT_S = 20.0

router = APIRouter()


def server_version() -> str:
    try:
        from importlib.metadata import version

        return version("moeserve")
    except Exception:  # noqa: BLE001 - running from a source tree that is not installed
        return "0.0.0+unknown"


def _check_healthy(ctx: ServerContext) -> None:
    if ctx.draining and ctx.client.healthy:
        raise APIError("the server is shutting down", 503, code="shutting_down")
    if not ctx.client.healthy:
        raise APIError(f"unhealthy: {ctx.client.dead_reason or 'the engine is not running'}", 503,
                       code="engine_dead")


@router.get("/health")
async def health(ctx: Ctx) -> Any:
    """Liveness: 200 {"status": "ok"} while the engine runs; 503 once it is dead or the server is stopping."""
    _check_healthy(ctx)
    return {"status": "ok"}


@router.get("/health_generate")
async def health_generate(ctx: Ctx) -> Any:
    """Generate one token end to end: proves the workers step, not only that the process lives. A PD server
    (either side) runs it alone, without a peer: it checks this side's workers, whatever the other side does."""
    _check_healthy(ctx)
    bos = ctx.tokenizer.bos_token_id if ctx.tokenizer is not None else None
    obj = GenerateInput(input_ids=[bos if bos is not None else 0],
                        sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                        rid=f"health-{uuid.uuid4().hex}", local=True)  # a PD server runs it alone
    gen = ctx.client.generate(obj)

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
    return {"status": "ok"}


@router.get("/get_server_info")
@router.get("/server_info")
async def get_server_info(ctx: Ctx) -> Any:
    info = dataclasses.asdict(ctx.client.server_args)
    info.update({
        "version": server_version(),
        "served_model_name": ctx.model_name,
        "context_length": ctx.context_length,
        "max_total_tokens": ctx.kv_capacity,
        "weight_format": ctx.client.weight_format,
        "internal_states": [x.to_json() for x in ctx.client.last_load],
    })
    if ctx.client.server_args.ep_dispatch_algorithm == "fake":  # a load test, not a model: say so
        info["fake_dispatch"] = "experts picked uniformly at random (--ep-dispatch-algorithm fake): outputs are meaningless"
    report = next((x.eplb for x in ctx.client.last_load if x.eplb is not None), None)
    if report is not None:  # --enable-eplb: rebalances so far and the last window's balancedness
        info["eplb"] = {"rebalances": report.rebalances, "balancedness": report.balancedness}
    return info


@router.get("/get_model_info")
@router.get("/model_info")
async def get_model_info(ctx: Ctx) -> Any:
    args = ctx.client.server_args
    cfg = ctx.client.model_config
    return {
        "model_path": args.model_path,
        "tokenizer_path": None if ctx.tokenizer is None else (args.tokenizer_path or args.model_path),
        "is_generation": True,
        "served_model_name": ctx.model_name,
        "architecture": cfg.architecture,
        "context_length": ctx.context_length,
        "vocab_size": cfg.vocab_size,
    }


@router.get("/version")
async def version() -> Any:
    return {"version": server_version()}


@router.get("/metrics")
async def metrics(ctx: Ctx) -> Any:
    return Response(ctx.metrics.render(list(ctx.client.last_load)), media_type=CONTENT_TYPE)
