"""The bootstrap server of a prefill server, and the two clients of it (a prefill rank registering, a decode rank
asking where a room's prefill runs).

The prefill server process runs it on --disaggregation-bootstrap-port (the port sglang-router passes to decode as
`bootstrap_port`). Each prefill DP group's leader rank registers its control address and its KV layout
(`PUT /register`). When a request reaches the prefill server, its TokenizerManager records which DP group got the
room (chosen by load, or the request's data_parallel_rank); decode asks `GET /route?room=R` and the answer waits
(up to `wait_s`) for the prefill side to have seen the room, since the router posts to both sides at once.
With --api-key every call needs `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger(__name__)

MAX_ROUTE_WAIT_S = 2.0  # one long poll; the client asks again until its own deadline
REGISTER_RETRY_S = 60.0


class BootstrapError(RuntimeError):
    """The bootstrap server could not be reached, refused the caller, or does not know the room."""

    def __init__(self, message: str, retry: bool = False):
        super().__init__(message)
        self.retry = retry  # the room is not known yet: asking again later may succeed


class BootstrapServer:
    """Prefill ranks' registrations and the DP group of each live room, over HTTP (a thread of its own)."""

    def __init__(self, host: str, port: int, api_key: str | None, num_dp: int):
        self.api_key = api_key
        self.num_dp = num_dp
        self.ranks: dict[int, dict[str, Any]] = {}  # dp rank -> registration
        self.rooms: dict[int, int] = {}  # room -> dp rank
        self._cond = threading.Condition()
        handler = type("Handler", (_Handler,), {"server_state": self})
        try:
            self.httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as e:
            raise ValueError(f"the bootstrap server cannot listen on {host}:{port} ({e}): choose another "
                             "--disaggregation-bootstrap-port") from None
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="pd-bootstrap", daemon=True)
        self.thread.start()
        logger.info("PD bootstrap server on %s:%d", host, self.port)

    def assign_room(self, room: int, dp_rank: int) -> None:
        """The prefill server took a request of `room` into DP group dp_rank."""
        with self._cond:
            self.rooms[room] = dp_rank
            self._cond.notify_all()

    def release_room(self, room: int) -> None:
        with self._cond:
            self.rooms.pop(room, None)

    def register(self, info: dict[str, Any]) -> None:
        with self._cond:
            self.ranks[int(info["dp_rank"])] = info
            self._cond.notify_all()
        logger.info("prefill DP group %s registered at %s", info["dp_rank"], info["addr"])

    def route(self, room: int, wait_s: float) -> dict[str, Any] | None:
        """The registration of the rank that holds `room`, waiting up to wait_s for it; None if still unknown."""
        deadline = time.monotonic() + min(wait_s, MAX_ROUTE_WAIT_S)
        with self._cond:
            while True:
                dp = self.rooms.get(room)
                if dp is not None and dp in self.ranks:
                    return self.ranks[dp]
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    server_state: BootstrapServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        logger.debug("bootstrap: " + format, *args)

    def _authorized(self, answer: bool = True) -> bool:
        key = self.server_state.api_key
        if key is None:
            return True
        given = self.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return True
        if answer:
            self._answer(401, {"error": "the bootstrap server needs Authorization: Bearer <--api-key>"})
        return False

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urllib.parse.urlparse(self.path)
        if url.path == "/health" and not self._authorized(answer=False):  # open, but names no rank
            self._answer(200, {"status": "ok"})
            return
        if not self._authorized():
            return
        if url.path == "/health":
            self._answer(200, {"status": "ok", "registered": sorted(self.server_state.ranks)})
            return
        if url.path != "/route":
            self._answer(404, {"error": f"no {url.path}"})
            return
        q = urllib.parse.parse_qs(url.query)
        try:
            room = int(q["room"][0])
            wait_s = float(q.get("wait_s", ["0"])[0])
        except (KeyError, ValueError):
            self._answer(400, {"error": "GET /route needs room=<int> (and optionally wait_s=<seconds>)"})
            return
        info = self.server_state.route(room, wait_s)
        if info is None:
            self._answer(404, {"error": f"room {room} is not known (yet) to this prefill server"})
        else:
            self._answer(200, info)

    def do_PUT(self) -> None:  # noqa: N802
        if not self._authorized():
            return
        if urllib.parse.urlparse(self.path).path != "/register":
            self._answer(404, {"error": f"no {self.path}"})
            return
        try:
            info = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            dp = int(info["dp_rank"])
            if not 0 <= dp < self.server_state.num_dp or not isinstance(info.get("addr"), str):
                raise ValueError(f"dp_rank {dp} out of range or no addr")
        except (ValueError, KeyError, TypeError) as e:
            self._answer(400, {"error": f"bad registration: {e}"})
            return
        self.server_state.register(info)
        self._answer(200, {"status": "ok"})


def _request(url: str, api_key: str | None, method: str = "GET", body: dict | None = None,
             timeout: float = 5.0) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if api_key is not None:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:300]
        raise BootstrapError(f"{method} {url}: HTTP {e.code}: {detail}", retry=e.code == 404) from None
    except (urllib.error.URLError, OSError) as e:
        raise BootstrapError(f"{method} {url}: {e}") from None


def register_rank(host: str, port: int, info: dict[str, Any], api_key: str | None) -> None:
    """A prefill rank registers with its server's bootstrap server (retrying while that one starts)."""
    deadline = time.monotonic() + REGISTER_RETRY_S
    while True:
        try:
            _request(f"http://{host}:{port}/register", api_key, "PUT", info)
            return
        except BootstrapError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"could not register with the bootstrap server: {e}") from None
            time.sleep(0.2)


def lookup_route(host: str, port: int, room: int, api_key: str | None, timeout_s: float) -> dict[str, Any]:
    """The registration of the prefill rank that holds `room`, asking until timeout_s has passed."""
    deadline = time.monotonic() + timeout_s
    h = f"[{host}]" if ":" in host else host
    while True:
        left = deadline - time.monotonic()
        try:
            return _request(f"http://{h}:{port}/route?room={room}&wait_s={max(left, 0):.3f}", api_key,
                            timeout=MAX_ROUTE_WAIT_S + 5.0)
        except BootstrapError as e:
            if not e.retry:
                raise
            if time.monotonic() >= deadline:
                raise BootstrapError(f"the prefill server at {host}:{port} did not receive room {room} within "
                                     f"{timeout_s:g} s (--disaggregation-bootstrap-timeout)") from None
