"""run_server: the server process's main. It starts the engine (server/startup.py: the ranks, a TokenizerManager),
serves the HTTP app with uvicorn, and stops the engine at the end, leaving no worker behind.

How it ends (docs/reliability.md):
- SIGTERM or SIGINT (to the server alone or to its whole process group: the ranks ignore both) drains: new
  requests get 503 and /health 503, the requests in flight have --shutdown-timeout seconds to finish, those still
  running then end with a 503 error (streams: an error event), and the process exits 0. A second signal stops at
  once, ending the rest the same way.
- A dead rank: the rank client names it (with its exit code or signal), every request fails with 503, and the
  process exits 1 within seconds, so that a supervisor restarts it.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from moeserve.args import ServerArgs
from moeserve.server.http.app import build_app
from moeserve.server.http.context import ServerContext
from moeserve.server.http.read_guard import guarded_protocol
from moeserve.server.startup import start_engine

logger = logging.getLogger(__name__)

EXIT_ENGINE_DEAD = 1
EXIT_STARTUP_FAILED = 1
CLOSE_TIMEOUT_S = 5.0  # for responses to finish writing once the requests have ended


def run_server(server_args: ServerArgs) -> int:
    """Start the engine, serve HTTP until a signal or a dead engine, stop the engine; the process's exit code."""
    # NOTE: until uvicorn takes the signals over, SIGTERM must unwind the stack (SystemExit), not kill the
    # process, so that the workers are stopped.
    busy = port_busy_reason(server_args.host, server_args.port)
    if busy is not None:  # before the model loads: with a large checkpoint the bind would fail minutes later
        logger.error("%s", busy)
        return EXIT_STARTUP_FAILED
    previous = _raise_on_sigterm()
    client = None
    exit_code = 0
    try:
        client = start_engine(server_args)
        app = build_app(client)
        config = uvicorn.Config(app, host=server_args.host, port=server_args.port,
                                log_level=server_args.log_level, access_log=False, timeout_keep_alive=30,
                                http=guarded_protocol(server_args.http_header_timeout, server_args.http_read_timeout),
                                timeout_graceful_shutdown=CLOSE_TIMEOUT_S, lifespan="off")
        server = _Server(config)
        server.moeserve_ctx = app.state.ctx
        server.shutdown_timeout = server_args.shutdown_timeout
        server.run()
        exit_code = server.exit_code
    except KeyboardInterrupt:
        logger.info("interrupted; shutting down")
    except SystemExit as e:
        # Our SIGTERM handler raises SystemExit(128 + signum): a stop, exit 0. Any other SystemExit is a start-up
        # that failed (uvicorn exits 3 when it cannot bind): a supervisor must see it.
        if isinstance(e.code, int) and e.code - 128 in (signal.SIGTERM, signal.SIGINT):
            logger.info("interrupted; shutting down")
        else:
            exit_code = e.code if isinstance(e.code, int) and e.code else EXIT_STARTUP_FAILED
            logger.error("start-up failed (exit code %d)", exit_code)
    finally:
        if client is not None:
            client.shutdown()
        logger.info("moeserve stopped%s", f" (exit code {exit_code})" if exit_code else "")
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return exit_code


def port_busy_reason(host: str, port: int) -> str | None:
    """Why the HTTP server could not listen on host:port (a bind test, as uvicorn binds: SO_REUSEADDR), or None."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"cannot listen on --host {host!r}: {e.strerror}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            # lower case, as uvicorn's own bind error (tests/disagg/pd_procs.py retries on "address already in use")
            return (f"cannot listen on {host}:{port}: {(e.strerror or str(e)).lower()}; is another server running "
                    "there? Stop it or pass another --port")
    return None


def _raise_on_sigterm() -> Any:
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, handler)


class _Server(uvicorn.Server):
    """uvicorn's Server, with moeserve's drain on a stop signal and its exit when the engine dies."""

    moeserve_ctx: ServerContext | None = None
    shutdown_timeout: float = 0.0
    exit_code = 0
    _drain_deadline: float | None = None

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            host = self.config.host if ":" not in self.config.host else f"[{self.config.host}]"
            name = self.moeserve_ctx.model_name if self.moeserve_ctx else "?"
            logger.info("moeserve serving %s at http://%s:%d (OpenAI API under /v1)", name, host, self.config.port)

    def handle_exit(self, sig: int, frame: Any) -> None:
        ctx = self.moeserve_ctx
        if ctx is not None and self._drain_deadline is None and self.shutdown_timeout > 0 and not self.should_exit:
            self._drain_deadline = time.monotonic() + self.shutdown_timeout
            ctx.draining = True
            logger.info("%s: draining %d request(s) in flight for up to %.0f s (--shutdown-timeout); new ones get "
                        "503; a second signal stops at once", signal.Signals(sig).name, ctx.num_http_requests,
                        self.shutdown_timeout)
            return
        if ctx is not None:
            ctx.draining = True
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        ctx = self.moeserve_ctx
        if ctx is not None and not self.should_exit:
            if not ctx.client.healthy:
                logger.error("the engine is dead (%s): stopping the server, exit code %d, so that a supervisor "
                             "restarts it", ctx.client.dead_reason, EXIT_ENGINE_DEAD)
                self.exit_code = EXIT_ENGINE_DEAD
                ctx.draining = True
                self.config.timeout_graceful_shutdown = 1.0  # the requests have failed already
                self.should_exit = True
            elif self._drain_deadline is not None and (ctx.num_http_requests == 0
                                                       or time.monotonic() >= self._drain_deadline):
                self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: Any = None) -> None:
        # Requests still running end now with a clear error (never a 200 with what they had so far), so that
        # their responses complete at once instead of being cut when the close timeout runs out.
        ctx = self.moeserve_ctx
        if ctx is not None:
            ctx.draining = True
            if ctx.inflight:
                why = (f"it did not finish within --shutdown-timeout {self.shutdown_timeout:g} s"
                       if self._drain_deadline is not None else "the server was stopped at once")
                logger.info("shutting down: ending %d request(s) still in flight (%s)", len(ctx.inflight), why)
                ctx.fail_inflight(f"the server is shutting down: the request was ended unfinished, as {why}")
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
