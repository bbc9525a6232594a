"""The decode side of PD disaggregation: per-request states from arrival until the prompt's KV is in the pool.

    bootstrapping --route known--> waiting --pages + slot reserved, `dest` sent--> transferring --`done`--> (running)
          |                          |                                               |
          +------- failed / aborted -+------------- `failed`, timeout, dead peer ----+--> (ended)
    transferring --abort or timeout, `cancel` sent--> cancelling --`done`/`failed` acknowledged--> (pages freed)

bootstrapping: a worker thread asks the prefill server's bootstrap server which rank holds the room.
waiting: admitted in arrival order only when the host (the scheduler) can reserve the prompt's pages and a request
slot without touching what running requests need, and only while the rooms whose prefill has not started hold
at most `ahead_pages` (back-pressure: the rest wait; a request waits at most --disaggregation-waiting-timeout;
`wait` tells prefill that the room is queued here, so prefill times it by this side's heartbeat, not a clock).
transferring: the request waits in prefill's queue (at most --disaggregation-waiting-timeout), then prefill
reports `started` and writes into the reserved pages (through the backend's window for the request) and reports
`done` with the sampled tokens, within --disaggregation-transfer-timeout of `started`. Pages go back to the pool only after
the writer acknowledged completion or cancellation, after it was declared dead, or after a further transfer
timeout (the window is closed first, so a zmq write that comes even later is dropped; a one-sided backend such as
Mooncake cannot drop it, so there the pages wait UNGUARDED_HOLD transfer timeouts while the writer's heartbeat
is heard).
The scheduler owns the requests; this class holds them only while they are in these states.

With attention TP every rank of the group runs this machine on the same events (group.py): the leader collects
them (`collect`: control messages, finished lookups, dead peers, the clock) and every rank applies them (`apply`).
`dest` names every rank's endpoint; each rank opens the same window over its own pool.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from moeserve.disagg.bootstrap import BootstrapError, lookup_route
from moeserve.disagg.control import ControlChannel
from moeserve.disagg.group import RankGroup
from moeserve.disagg.liveness import Heartbeat
from moeserve.disagg.stats import TransferStats
from moeserve.disagg.transfer.base import TransferBackend

logger = logging.getLogger(__name__)

STATES = ("bootstrapping", "waiting", "transferring", "cancelling")
# One-sided writes (Mooncake) cannot be refused once the pages are freed: a room whose cancellation is not
# acknowledged keeps its pages while the writer lives, up to this many transfer timeouts.
UNGUARDED_HOLD = 4
OVERLOADED = 429  # a queue wait ran out at a healthy peer: sglang-router retries it, and its breaker stays closed


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
    seq: int  # this room's number on this side, the same on every rank of the group
    bootstrap: tuple[str, int]
    since: float
    state: str = "bootstrapping"
    route: dict[str, Any] | None = None
    window: str | None = None
    reserved: bool = False  # holds pages from pd_reserve
    pages: int = 0  # how many
    started: bool = False  # prefill reported its first write: the transfer deadline runs
    aborted: bool = False  # the client is answered already; only the clean-up is left

    @property
    def addr(self) -> str | None:
        return self.route["addr"] if self.route else None

    @property
    def hb(self) -> str | None:
        return self.route["hb"] if self.route else None


class DecodeRooms:
    """The decode side's PD requests of one attention group, driven by the scheduler's loop (poll, or collect on
    the leader and apply on every rank). channel and heartbeat: the leader's; None on the other ranks."""

    def __init__(self, host: DecodeHost, backend: TransferBackend, channel: ControlChannel | None,
                 heartbeat: Heartbeat | None, identity: dict[str, Any], api_key: str | None,
                 bootstrap_timeout_s: float, waiting_timeout_s: float, transfer_timeout_s: float,
                 group: RankGroup | None = None, ahead_pages: int | None = None):
        self.host = host
        self.backend = backend
        self.channel = channel
        self.identity = identity  # model, page size, backend: must equal the prefill rank's
        self.api_key = api_key
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.waiting_timeout_s = waiting_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.ahead_pages = ahead_pages  # most pages reserved for rooms whose prefill has not started (None: any)
        self.heartbeat = heartbeat
        self.group = group or RankGroup(endpoints=[backend.endpoint()])
        self.rooms: dict[int, DecodeRoom] = {}
        self.by_req: dict[int, DecodeRoom] = {}  # id(req) -> room
        self.by_seq: dict[int, DecodeRoom] = {}
        self._seq = 0
        self.now = time.monotonic()  # the leader's clock, as of the last events applied
        self._lookups: dict[int, Future] = {}  # leader: seq -> the bootstrap lookup in flight
        self._unsent: list[int] = []  # leader: rooms whose `dest` could not be queued
        self.lookups = ThreadPoolExecutor(max_workers=8, thread_name_prefix="pd-lookup") if self.leader else None
        self.stats = TransferStats("decode", STATES)

    gathers = False  # decode ranks start no writes: the leader's events are all there is

    @property
    def leader(self) -> bool:
        return self.group.leader

    # ------------------------------------------------------------------ in
    def add(self, req: Any, room: int, host: str, port: int) -> str | None:
        """Start a request; an error message instead when its room is already live here."""
        if room in self.rooms:
            return f"bootstrap_room {room} is already in use on this decode server"
        self._seq += 1
        rec = DecodeRoom(req, room, self._seq, (host, port), self.now)
        if self.lookups is not None:
            self._lookups[rec.seq] = self.lookups.submit(lookup_route, host, port, room, self.api_key,
                                                         self.bootstrap_timeout_s)
        self.rooms[room] = rec
        self.by_req[id(req)] = rec
        self.by_seq[rec.seq] = rec
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
        self._ended(rec, "aborted", "the request was aborted (client gone or /abort_request)")
        rec.aborted = True
        if rec.state == "transferring":
            self._cancel(rec, self.now)
        elif rec.state == "waiting":
            self._send(rec.addr, {"kind": "cancel", "room": rec.room})
            self._drop(rec)
        # bootstrapping: the lookup finishes first (apply), then the cancel goes out

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
        """One rank alone: collect and apply."""
        self.apply([self.collect()])

    def collect(self) -> dict[str, Any] | None:
        """Leader: what happened since the last call (broadcast to the group with the step's messages); None
        elsewhere."""
        if not self.leader:
            return None
        routes: dict[int, tuple[bool, Any]] = {}
        for seq, fut in list(self._lookups.items()):
            if fut.done():
                del self._lookups[seq]
                try:
                    routes[seq] = (True, fut.result())
                except BootstrapError as e:
                    routes[seq] = (False, str(e))
        live = {r.hb for r in self.rooms.values() if r.state != "bootstrapping" and r.hb}
        unsent, self._unsent = self._unsent, []
        return {"now": time.monotonic(), "routes": routes, "msgs": self.channel.recv_all(),
                "dead": self.heartbeat.watch(live), "unsent": unsent}

    def apply(self, parts: list[dict[str, Any] | None]) -> None:
        """Every rank: the leader's events (parts[0]), in the same order on every rank."""
        ev = parts[0]
        self.now = now = ev["now"]
        for seq, (ok, value) in ev["routes"].items():
            rec = self.by_seq.get(seq)
            if rec is not None and rec.state == "bootstrapping":
                self._on_route(rec, ok, value, now)
        for seq in ev["unsent"]:
            rec = self.by_seq.get(seq)
            if rec is not None and rec.state == "transferring":
                self._end_transfer(rec, "the prefill rank does not read its control socket", 503, "unsent")
        for msg in ev["msgs"]:
            self._on_message(msg, now)
        self._admit(now)
        self._expire(now)
        self._on_dead(ev["dead"])
        self.stats.states = self.counts()

    def _on_route(self, rec: DecodeRoom, ok: bool, value: Any, now: float) -> None:
        if not ok:
            self._fail(rec, f"PD bootstrap failed: {value}", 503, "bootstrap")
            return
        rec.route = value
        if rec.aborted:
            self._send(rec.addr, {"kind": "cancel", "room": rec.room})
            self._drop(rec)
            return
        mismatch = self._mismatch(rec.route)
        if mismatch:  # prefill's request learns it at once too
            self._send(rec.addr, {"kind": "cancel", "room": rec.room})
            self._fail(rec, f"prefill and decode cannot pair: {mismatch}", 500, "mismatch")
            return
        rec.state, rec.since = "waiting", now
        self._send(rec.addr, {"kind": "wait", "room": rec.room, "hb": self.heartbeat.addr if self.heartbeat else None})

    def _mismatch(self, route: dict[str, Any]) -> str | None:
        theirs = route.get("identity", {})
        for key, mine in self.identity.items():
            if theirs.get(key) == mine:
                continue
            if key == "speculative":
                return ("speculative decoding is on one side only: the prefill server sends the draft model's KV "
                        "and hidden state that the decode server drafts from; give both sides the same "
                        "--speculative-algorithm (or neither)")
            if key == "attn_tp_size":
                return (f"GQA's KV heads are split over attention-TP ranks: the prefill server runs attention TP "
                        f"{theirs.get(key)}, this decode server {mine}; run both with the same attention TP size "
                        "(--tp-size, or --dp-size with --enable-dp-attention)")
            return (f"{key} is {theirs.get(key)!r} on the prefill server and {mine!r} here; both sides need the "
                    "same model, --page-size, --dtype, KV layout and --disaggregation-transfer-backend")
        return None

    def _admit(self, now: float) -> None:
        ahead = sum(r.pages for r in self.rooms.values() if r.state == "transferring" and not r.started)
        for rec in [r for r in self.rooms.values() if r.state == "waiting"]:  # arrival order
            if ahead and self.ahead_pages is not None and ahead >= self.ahead_pages:
                return  # prefill has not started what it has: reserve no more pages for its queue
            pages = self.host.pd_reserve(rec.req)
            if pages is None:
                return  # the head waits; later ones do not overtake it
            ahead += len(pages)
            rec.reserved, rec.pages = True, len(pages)
            rec.window = f"{self.group.token}-{rec.seq}"
            self.backend.open_window(rec.window, pages)
            peers = [{**ep, "window": rec.window} for ep in self.group.endpoints]
            rec.state, rec.since = "transferring", now
            if not self._send(rec.addr, {"kind": "dest", "room": rec.room, "hb": self.heartbeat.addr if
                                         self.heartbeat else None, "pages": pages, "peers": peers,
                                         "identity": self.identity}):
                self._unsent.append(rec.seq)  # every rank ends it with the next events

    def _on_message(self, msg: dict[str, Any], now: float) -> None:
        addr = msg.get("from")
        rec = self.rooms.get(msg.get("room")) if "room" in msg else None
        if rec is None or rec.state == "bootstrapping" or rec.addr != addr:
            return
        if msg["kind"] == "started" and rec.state == "transferring":
            rec.started, rec.since = True, now
        elif rec.state == "waiting":
            if msg["kind"] == "failed":  # prefill gave up on the room before decode admitted it
                self._fail(rec, f"the prefill server failed the request: {msg.get('reason')}", 503, "prefill_failed")
        elif msg["kind"] == "done":
            self.stats.on_transfer(int(msg.get("bytes", 0)), now - rec.since)
            if rec.state == "cancelling":
                self._end_transfer(rec, None, 0)
            else:
                self.backend.close_window(rec.window)
                rec.reserved = False
                self._drop(rec)
                self.host.pd_activate(rec.req, msg)
        elif msg["kind"] == "failed":
            self._end_transfer(rec, f"the prefill server failed the KV transfer: {msg.get('reason')}", 503,
                               "prefill_failed")

    def _expire(self, now: float) -> None:
        for rec in list(self.rooms.values()):
            age = now - rec.since
            if rec.state == "waiting" and age > self.waiting_timeout_s:
                self._fail(rec, f"no KV cache space for the request within {self.waiting_timeout_s:g} s "
                                "(--disaggregation-waiting-timeout); retry later", OVERLOADED, "waiting_timeout")
            elif rec.state == "transferring" and not rec.started and age > self.waiting_timeout_s:
                self._cancel(rec, now, f"the prefill server did not start the request within "
                                       f"{self.waiting_timeout_s:g} s (--disaggregation-waiting-timeout); retry "
                                       "later", "waiting_timeout", OVERLOADED)
            elif rec.state == "transferring" and rec.started and age > self.transfer_timeout_s:
                self._cancel(rec, now, f"the KV transfer did not finish within {self.transfer_timeout_s:g} s of its "
                                       "start (--disaggregation-transfer-timeout)", "transfer_timeout")
            elif rec.state == "cancelling" and age > self._hold_s:
                if self.leader:
                    logger.warning("room %d: the prefill rank did not acknowledge the cancellation within %g s; "
                                   "freeing its pages", rec.room, self._hold_s)
                self._end_transfer(rec, None, 0)

    @property
    def _hold_s(self) -> float:
        """How long a cancelled room keeps its pages without the writer's acknowledgement: a backend that refuses
        late writes (its window closes first) needs one transfer timeout; a one-sided one waits longer, while
        the heartbeat still hears the writer (a dead writer frees them at once, _on_dead)."""
        return self.transfer_timeout_s * (1 if self.backend.refuses_late_writes else UNGUARDED_HOLD)

    def _on_dead(self, dead: list[str]) -> None:
        for hb in dead:
            if self.leader:
                logger.error("the prefill rank with heartbeat %s went silent: failing its requests", hb)
            for rec in [r for r in self.rooms.values() if r.hb == hb]:
                if self.channel is not None:
                    self.channel.forget(rec.addr)
                reason = (f"the prefill server ({rec.bootstrap[0]}:{rec.bootstrap[1]}) stopped answering "
                          "(no heartbeat within --disaggregation-heartbeat-timeout)")
                if rec.state == "waiting":
                    self._fail(rec, reason, 503, "peer_dead")
                else:
                    self._end_transfer(rec, reason, 503, "peer_dead")

    # ------------------------------------------------------------------ endings
    def _send(self, addr: str | None, msg: dict[str, Any]) -> bool:
        """The leader sends (True when queued); the other ranks only keep the state."""
        if self.channel is None or addr is None:
            return True
        return self.channel.send(addr, {**msg, "from": self.channel.addr})

    def _cancel(self, rec: DecodeRoom, now: float, reason: str | None = None, cause: str = "",
                status: int = 503) -> None:
        """Ask prefill to stop; the pages stay reserved until it acknowledges (or the wait times out)."""
        self._send(rec.addr, {"kind": "cancel", "room": rec.room})
        if reason is not None and not rec.aborted:
            self._ended(rec, cause, reason)
            self.host.pd_fail(rec.req, reason, status)
        rec.aborted = True
        rec.state, rec.since = "cancelling", now

    def _end_transfer(self, rec: DecodeRoom, reason: str | None, status: int = 0, cause: str = "") -> None:
        """The writer is finished with the pages (acknowledged, failed, dead or given up on): free them."""
        self.backend.close_window(rec.window)
        self.host.pd_release(rec.req)
        rec.reserved = False
        if reason is not None:
            self._fail(rec, reason, status, cause)
        else:
            self._drop(rec)

    def _fail(self, rec: DecodeRoom, message: str, status: int, cause: str) -> None:
        if not rec.aborted:
            self._ended(rec, cause, message)
            self.host.pd_fail(rec.req, message, status)
        self._drop(rec)

    def _ended(self, rec: DecodeRoom, cause: str, message: str) -> None:
        """A request that will not finish: logged once (by the leader) and counted by cause."""
        if self.leader:
            logger.log(logging.INFO if cause == "aborted" else logging.WARNING, "room %d failed (%s): %s",
                       rec.room, cause, message)
        self.stats.on_failure(cause)

    def _drop(self, rec: DecodeRoom) -> None:
        self.rooms.pop(rec.room, None)
        self.by_req.pop(id(rec.req), None)
        self.by_seq.pop(rec.seq, None)

    def close(self) -> None:
        if self.lookups is not None:
            self.lookups.shutdown(wait=False, cancel_futures=True)
        if self.heartbeat is not None:
            self.heartbeat.close()
