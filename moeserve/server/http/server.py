"""run_server: the server process's main. It starts the engine (a TokenizerManager, which starts the ranks),
serves the HTTP app with uvicorn until SIGINT or SIGTERM, then stops the engine, leaving no worker behind."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

from moeserve.args import ServerArgs
from moeserve.server.http.app import build_app
from moeserve.server.http.context import ServerContext
from moeserve.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)


def run_server(server_args: ServerArgs) -> None:
    """Start the engine, serve HTTP until SIGINT/SIGTERM, then stop the engine (no orphan workers)."""
    # NOTE: SIGTERM must unwind the stack (SystemExit), not kill the process, so that the workers are stopped.
    previous = _raise_on_sigterm()
    client = None
    try:
        client = TokenizerManager(server_args)
        app = build_app(client)
        config = uvicorn.Config(app, host=server_args.host, port=server_args.port,
                                log_level=server_args.log_level, access_log=False,
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
