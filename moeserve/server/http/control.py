"""Control endpoints: GET /get_load, POST /flush_cache, POST /abort_request, and the expert-distribution
recording (--expert-distribution-recorder-mode stat; SGLang's three endpoints):
POST /start_expert_distribution_record, /stop_expert_distribution_record, /dump_expert_distribution_record."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from moeserve.eplb.recorder import expert_distribution_dir
from moeserve.server.http.context import Ctx
from moeserve.server.http.errors import APIError, engine_error
from moeserve.server.http.protocol import AbortRequest, DumpExpertDistributionRequest

CONTROL_TIMEOUT_S = 30.0

T = TypeVar("T")

router = APIRouter()


async def _control(call: Awaitable[T], refused: tuple[type[Exception], ...] = ()) -> T:
    """The engine's answer to a control request, or the HTTP error for its failure: 400 for an exception in
    `refused` (the engine saying it cannot, e.g. it records no expert distribution), else engine_error's."""
    try:
        return await asyncio.wait_for(call, CONTROL_TIMEOUT_S)
    except refused as e:
        raise APIError(str(e), 400) from None
    except Exception as e:  # noqa: BLE001
        raise engine_error(e) from None


@router.get("/get_load")
async def get_load(ctx: Ctx) -> Any:
    loads = await _control(ctx.client.get_load())
    return [x.to_json() for x in loads]


@router.api_route("/flush_cache", methods=["POST", "GET"])
async def flush_cache(ctx: Ctx) -> Any:
    if await _control(ctx.client.flush_cache()):
        return {"success": True, "message": "Cache flushed."}
    return JSONResponse({"success": False, "message": "Cache not flushed: requests are running; retry when "
                         "the server is idle."}, status_code=400)


@router.post("/abort_request")
async def abort_request(request: Request, ctx: Ctx) -> Any:
    req = await ctx.read_body(request, AbortRequest, "/abort_request request")
    if not req.rid and not req.abort_all:
        raise APIError("give the rid of the request to abort, or abort_all: true", 400, param="rid")
    rids = list(ctx.inflight) if req.abort_all else [req.rid]
    aborted = []
    for rid in rids:
        sub = ctx.inflight.get(rid)
        try:
            await ctx.client.abort(rid)
        except Exception as e:  # noqa: BLE001
            raise engine_error(e) from None
        if sub is not None:
            sub.abort("aborted by /abort_request")
            aborted.append(rid)
    return {"aborted": aborted}


# ----------------------------------------------------------------------
# expert-distribution recording
# (the engine raises ValueError when it cannot: no recorder, or an unknown action)
@router.api_route("/start_expert_distribution_record", methods=["POST", "GET"])
async def start_expert_distribution_record(ctx: Ctx) -> Any:
    await _control(ctx.client.expert_distribution("start"), refused=(ValueError,))
    return {"success": True, "message": "Expert distribution recording started."}


@router.api_route("/stop_expert_distribution_record", methods=["POST", "GET"])
async def stop_expert_distribution_record(ctx: Ctx) -> Any:
    await _control(ctx.client.expert_distribution("stop"), refused=(ValueError,))
    return {"success": True, "message": "Expert distribution recording stopped."}


@router.api_route("/dump_expert_distribution_record", methods=["POST", "GET"])
async def dump_expert_distribution_record(request: Request, ctx: Ctx) -> Any:
    path = None
    req = await ctx.read_body(request, DumpExpertDistributionRequest, "/dump_expert_distribution_record request",
                              required=False)
    if req is not None and req.name is not None:  # a plain file name: an HTTP client does not choose where the
        # server writes
        if not req.name or Path(req.name).name != req.name or req.name.startswith("."):
            raise APIError(f"name {req.name!r}: give a plain file name, no directories", 400, param="name")
        path = str(expert_distribution_dir() / req.name)
    dump = await _control(ctx.client.dump_expert_distribution(path), refused=(ValueError,))
    return {"success": True, **dump}
