"""The decode side of PD disaggregation: per-request states from arrival until the prompt's KV is in the pool.

    bootstrapping --route known--> waiting --pages + slot reserved, `dest` sent--> transferring --`done`--> (running)
          |                          |                                               |
          +------- failed / aborted -+------------- `failed`, timeout, dead peer ----+--> (ended)
    transferring --abort or timeout, `cancel` sent--> cancelling --`done`/`failed` acknowledged--> (pages freed)

bootstrapping: a worker thread asks the prefill server's bootstrap server which rank holds the room.
waiting: admitted in arrival order only when the host (the scheduler) can reserve the prompt's pages and a request
slot without touching what running requests need (back-pressure: the rest wait; a request waits at most
--disaggregation-waiting-timeout). transferring: the prefill rank writes into the reserved pages (through the
backend's window for the request) and reports `done` with the first token. Pages go back to the pool only after
the writer acknowledged completion or cancellation, after it was declared dead, or after a further transfer
timeout (the window is closed first, so a zmq write that comes even later is dropped).
The scheduler owns the requests; this class holds them only while they are in these states.
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from moeserve.disagg.bootstrap import BootstrapError, lookup_route
from moeserve.disagg.control import ControlChannel
from moeserve.disagg.liveness import Heartbeat
from moeserve.disagg.stats import TransferStats
from moeserve.disagg.transfer.base import TransferBackend

logger = logging.getLogger(__name__)

STATES = ("bootstrapping", "waiting", "transferring", "cancelling")


class DecodeHost(Protocol):
    """What the scheduler does for the decode side (rank/pd_host.py)."""

    def pd_reserve(self, req: Any) -> list[int] | None: ...  # prompt pages + a slot, or None: not now
    def pd_release(self, req: Any) -> None: ...  # give back the pages and slot pd_reserve took
    def pd_activate(self, req: Any, done: dict[str, Any]) -> None: ...  # the KV is in: decode from here
    def pd_fail(self, req: Any, message: str, status: int) -> None: ...  # end the request with an error


@dataclass
class DecodeRoom:
    req: Any
    room: int
    bootstrap: tuple[str, int]
    state: str = "bootstrapping"
    since: float = field(default_factory=time.monotonic)
    lookup: Future | None = None
    route: dict[str, Any] | None = None
    window: str | None = None
    reserved: bool = False  # holds pages from pd_reserve
    aborted: bool = False  # the client is answered already; only the clean-up is left

    @property
    def addr(self) -> str | None:
        return self.route["addr"] if self.route else None

    @property
    def hb(self) -> str | None:
        return self.route["hb"] if self.route else None


class DecodeRooms:
    """The decode side's PD requests of one attention group, driven by the scheduler's loop (poll)."""

    def __init__(self, host: DecodeHost, backend: TransferBackend, channel: ControlChannel, heartbeat: Heartbeat,
                 identity: dict[str, Any], api_key: str | None, bootstrap_timeout_s: float, waiting_timeout_s: float,
                 transfer_timeout_s: float):
        self.host = host
        self.backend = backend
        self.channel = channel
        self.identity = identity  # model, page size, backend: must equal the prefill rank's
        self.api_key = api_key
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.waiting_timeout_s = waiting_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.heartbeat = heartbeat
        self.rooms: dict[int, DecodeRoom] = {}
        self.by_req: dict[int, DecodeRoom] = {}  # id(req) -> room
        self.lookups = ThreadPoolExecutor(max_workers=8, thread_name_prefix="pd-lookup")
        self.stats = TransferStats("decode", STATES)
        self.endpoint = backend.endpoint()

    # ------------------------------------------------------------------ in
    def add(self, req: Any, room: int, host: str, port: int) -> str | None:
        """Start a request; an error message instead when its room is already live here."""
        if room in self.rooms:
            return f"bootstrap_room {room} is already in use on this decode server"
        rec = DecodeRoom(req, room, (host, port))
        rec.lookup = self.lookups.submit(lookup_route, host, port, room, self.api_key, self.bootstrap_timeout_s)
        self.rooms[room] = rec
        self.by_req[id(req)] = rec
        return None

    def holds(self, req: Any) -> bool:
        rec = self.by_req.get(id(req))
        return rec is not None and not rec.aborted

    def reserved_reqs(self) -> list[Any]:
        """Requests holding reserved pages (their future tokens count against admission)."""
        return [r.req for r in self.rooms.values() if r.reserved and not r.aborted]

    def abort(self, req: Any) -> None:
        """The client is gone (the scheduler answered it): tell prefill, give pages back once it acknowledged."""
        rec = self.by_req.get(id(req))
        if rec is None or rec.aborted:
            return
        rec.aborted = True
        if rec.state == "transferring":
            self._cancel(rec, time.monotonic())
        elif rec.state == "waiting":
            self.channel.send(rec.addr, {"kind": "cancel", "room": rec.room, "from": self.channel.addr})
            self._drop(rec)
        # bootstrapping: the lookup finishes first (poll), then the cancel goes out

    @property
    def busy(self) -> bool:
        return bool(self.rooms)

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(STATES, 0)
        for r in self.rooms.values():
            out[r.state] += 1
        return out

    # ------------------------------------------------------------------ the loop
    def poll(self) -> None:
        now = time.monotonic()
        for rec in [r for r in self.rooms.values() if r.state == "bootstrapping" and r.lookup.done()]:
            self._on_route(rec, now)
        for msg in self.channel.recv_all():
            self._on_message(msg, now)
        self._admit(now)
        self._expire(now)
        self._heartbeat(now)
        self.stats.states = self.counts()

    def _on_route(self, rec: DecodeRoom, now: float) -> None:
        try:
            rec.route = rec.lookup.result()
        except BootstrapError as e:
            self._fail(rec, f"PD bootstrap failed: {e}", 503)
            return
        rec.lookup = None
        if rec.aborted:
            self.channel.send(rec.addr, {"kind": "cancel", "room": rec.room, "from": self.channel.addr})
            self._drop(rec)
            return
        mismatch = self._mismatch(rec.route)
        if mismatch:  # prefill's request learns it at once too
            self.channel.send(rec.addr, {"kind": "cancel", "room": rec.room, "from": self.channel.addr})
            self._fail(rec, f"prefill and decode cannot pair: {mismatch}", 500)
            return
        rec.state, rec.since = "waiting", now

    def _mismatch(self, route: dict[str, Any]) -> str | None:
        theirs = route.get("identity", {})
        for key, mine in self.identity.items():
            if theirs.get(key) != mine:
                return (f"{key} is {theirs.get(key)!r} on the prefill server and {mine!r} here; both sides need the "
                        "same model, --page-size, --dtype, KV layout and --disaggregation-transfer-backend")
        return None

    def _admit(self, now: float) -> None:
        for rec in [r for r in self.rooms.values() if r.state == "waiting"]:  # arrival order
            pages = self.host.pd_reserve(rec.req)
            if pages is None:
                return  # the head waits; later ones do not overtake it
            rec.reserved = True
            rec.window = uuid.uuid4().hex
            self.backend.open_window(rec.window, pages)
            ok = self.channel.send(rec.addr, {
                "kind": "dest", "room": rec.room, "from": self.channel.addr, "hb": self.heartbeat.addr, "pages": pages,
                "peer": {**self.endpoint, "window": rec.window}, "identity": self.identity})
            rec.state, rec.since = "transferring", now
            if not ok:
                self._end_transfer(rec, "the prefill rank does not read its control socket", 503)

    def _on_message(self, msg: dict[str, Any], now: float) -> None:
        addr = msg.get("from")
        rec = self.rooms.get(msg.get("room")) if "room" in msg else None
        if rec is None or rec.state not in ("transferring", "cancelling") or rec.addr != addr:
            return
        if msg["kind"] == "done":
            self.stats.on_transfer(int(msg.get("bytes", 0)), now - rec.since)
            if rec.state == "cancelling":
                self._end_transfer(rec, None, 0)
            else:
                self.backend.close_window(rec.window)
                rec.reserved = False
                self._drop(rec)
                self.host.pd_activate(rec.req, msg)
        elif msg["kind"] == "failed":
            self._end_transfer(rec, f"the prefill server failed the KV transfer: {msg.get('reason')}", 503)

    def _expire(self, now: float) -> None:
        for rec in list(self.rooms.values()):
            age = now - rec.since
            if rec.state == "waiting" and age > self.waiting_timeout_s:
                self._fail(rec, f"no KV cache space for the request within {self.waiting_timeout_s:g} s "
                                "(--disaggregation-waiting-timeout)", 503)
            elif rec.state == "transferring" and age > self.transfer_timeout_s:
                self._cancel(rec, now, f"the KV transfer did not finish within {self.transfer_timeout_s:g} s "
                                       "(--disaggregation-transfer-timeout)")
            elif rec.state == "cancelling" and age > self.transfer_timeout_s:
                logger.warning("room %d: the prefill rank did not acknowledge the cancellation within %g s; "
                               "freeing its pages", rec.room, self.transfer_timeout_s)
                self._end_transfer(rec, None, 0)

    def _heartbeat(self, now: float) -> None:
        live = {r.hb for r in self.rooms.values() if r.state != "bootstrapping" and r.hb}
        for hb in self.heartbeat.watch(live):
            logger.error("the prefill rank with heartbeat %s sent nothing for %.1f s: failing its requests", hb,
                         self.heartbeat.dead_after_s)
            for rec in [r for r in self.rooms.values() if r.hb == hb]:
                self.channel.forget(rec.addr)
                reason = (f"the prefill server ({rec.bootstrap[0]}:{rec.bootstrap[1]}) stopped answering "
                          f"(no heartbeat for {self.heartbeat.dead_after_s:g} s)")
                if rec.state == "waiting":
                    self._fail(rec, reason, 503)
                else:
                    self._end_transfer(rec, reason, 503)

    # ------------------------------------------------------------------ endings
    def _cancel(self, rec: DecodeRoom, now: float, reason: str | None = None) -> None:
        """Ask prefill to stop; the pages stay reserved until it acknowledges (or the wait times out)."""
        self.channel.send(rec.addr, {"kind": "cancel", "room": rec.room, "from": self.channel.addr})
        if reason is not None and not rec.aborted:
            self.host.pd_fail(rec.req, reason, 503)
        rec.aborted = True
        rec.state, rec.since = "cancelling", now

    def _end_transfer(self, rec: DecodeRoom, reason: str | None, status: int) -> None:
        """The writer is finished with the pages (acknowledged, failed, dead or given up on): free them."""
        self.backend.close_window(rec.window)
        self.host.pd_release(rec.req)
        rec.reserved = False
        if reason is not None:
            self._fail(rec, reason, status)
        else:
            self._drop(rec)

    def _fail(self, rec: DecodeRoom, message: str, status: int) -> None:
        if not rec.aborted:
            logger.warning("room %d: %s", rec.room, message)
            self.host.pd_fail(rec.req, message, status)
            self.stats.failed += 1
        self._drop(rec)

    def _drop(self, rec: DecodeRoom) -> None:
        self.rooms.pop(rec.room, None)
        self.by_req.pop(id(rec.req), None)

    def close(self) -> None:
        self.lookups.shutdown(wait=False, cancel_futures=True)
        self.heartbeat.close()
