"""uvicorn's h11 protocol with read deadlines: a connection that takes over --http-header-timeout seconds to send a
request's headers (slowloris), or goes --http-read-timeout seconds without a byte in the middle of a body, is closed.
Between requests uvicorn's keep-alive timeout already applies."""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class GuardedH11Protocol(H11Protocol):
    header_timeout_s = 10.0  # set by guarded_protocol
    read_timeout_s = 30.0
    _deadline: asyncio.TimerHandle | None = None
    _headers_timer = False  # whether _deadline is the headers' (runs from their first byte, never re-armed)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.header_timeout_s, headers=True)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.IDLE and data and not self._headers_timer:  # a new request's first bytes
            self._arm(self.header_timeout_s, headers=True)
        elif state is h11.SEND_BODY:
            self._arm(self.read_timeout_s, headers=False)
        elif state is not h11.IDLE:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, seconds: float, headers: bool) -> None:
        self._disarm()
        self._deadline, self._headers_timer = self.loop.call_later(seconds, self._expire), headers

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._headers_timer = None, False

    def _expire(self) -> None:
        self._deadline = None
        if self.flow is not None and self.flow.read_paused:  # the app, not the client, is behind
            self._arm(self.read_timeout_s, headers=False)
        elif self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            self.transport.close()  # the app's receive() then sees the disconnect


def guarded_protocol(header_timeout_s: float, read_timeout_s: float) -> type[GuardedH11Protocol]:
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout_s": header_timeout_s, "read_timeout_s": read_timeout_s})
