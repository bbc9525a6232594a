"""The prefill side of PD disaggregation: per-request states from arrival until decode has the prompt's KV.

    bootstrapping --`dest` from decode--> prefilling --last chunk sampled--> transferring --all writes back--> done
         |                                    |                                  |
         +--- timeout / cancel / abort -------+------ write failed, `cancel`, abort, dead decode ----> failed

bootstrapping: the request waits (outside the scheduler's queue, holding no KV) for decode to say where to write;
at most --disaggregation-bootstrap-timeout. prefilling: the scheduler runs the prompt (chunked prefill, the radix
cache's prefix); after each chunk the pages that are complete are written to decode (page-aligned; the partial
last page goes with the last chunk). transferring: the first token is sampled, the last writes are in flight.
The request keeps its KV until every write it started has returned, then it goes to the radix cache (done) or
back to the pool (failed); only then does decode hear `done` (with the first token, its logprobs and
cached_tokens) or `failed`. Writes run on a pool of transfer threads; the scheduler's thread never waits on one.
"""

from __future__ import annotations

import logging
import queue
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from moeserve.disagg.control import ControlChannel
from moeserve.disagg.liveness import Heartbeat
from moeserve.disagg.stats import TransferStats
from moeserve.disagg.transfer.base import TransferBackend, TransferError, merge_runs

logger = logging.getLogger(__name__)

STATES = ("bootstrapping", "prefilling", "transferring")
TRANSFER_THREADS = 4  # per decode peer: a dead peer's writes block only their own threads until they time out


class PrefillHost(Protocol):
    """What the scheduler does for the prefill side (rank/pd_host.py)."""

    def pd_enqueue(self, req: Any) -> None: ...  # into the waiting queue: prefill it
    def pd_detach(self, req: Any) -> None: ...  # out of the queue and the running set, keeping its KV
    def pd_src_pages(self, req: Any, num_pages: int) -> list[int]: ...  # its first num_pages KV pages
    def pd_release(self, req: Any, cache: bool) -> None: ...  # free its KV (cache: into the radix tree)
    def pd_finish(self, req: Any, error: str | None) -> None: ...  # answer the prefill request
    def pd_prompt_len(self, req: Any) -> int: ...


@dataclass
class PrefillRoom:
    req: Any
    room: int
    state: str = "bootstrapping"
    since: float = field(default_factory=time.monotonic)
    dest: dict[str, Any] | None = None
    pages_sent: int = 0
    inflight: int = 0
    bytes: int = 0
    first: dict[str, Any] | None = None  # first token, logprobs, cached_tokens (after the last chunk)
    error: str | None = None  # set once the transfer cannot succeed; finalized when inflight reaches 0
    answered: bool = False  # the prefill request was answered already (the client aborted it)
    notify: bool = True  # tell decode how it ended (not when decode is dead)
    t_dest: float = 0.0  # when decode's `dest` came: the transfer's latency counts from here

    @property
    def decode_addr(self) -> str | None:
        return self.dest["from"] if self.dest else None

    @property
    def decode_hb(self) -> str | None:
        return self.dest.get("hb") if self.dest else None


class PrefillRooms:
    """The prefill side's PD requests of one attention group, driven by the scheduler's loop (poll)."""

    def __init__(self, host: PrefillHost, backend: TransferBackend, channel: ControlChannel, heartbeat: Heartbeat,
                 identity: dict[str, Any], page_size: int, bootstrap_timeout_s: float, transfer_timeout_s: float,
                 debug_failure_prob: float = 0.0, seed: int = 0):
        self.host = host
        self.backend = backend
        self.channel = channel
        self.identity = identity
        self.page_size = page_size
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.heartbeat = heartbeat
        self.debug_failure_prob = debug_failure_prob
        self._rng = random.Random(seed)
        self.rooms: dict[int, PrefillRoom] = {}
        self.by_req: dict[int, PrefillRoom] = {}
        self.early: dict[int, tuple[float, dict[str, Any]]] = {}  # room -> (arrival, dest or cancel) before the req
        # rooms that ended before decode's `dest` came (aborted, timed out): decode hears `failed` when it comes
        self.ended: dict[int, tuple[float, str]] = {}
        self.pools: dict[str, ThreadPoolExecutor] = {}  # decode control address -> its transfer threads
        self.results: queue.SimpleQueue = queue.SimpleQueue()
        self.stats = TransferStats("prefill", STATES)

    # ------------------------------------------------------------------ in
    def add(self, req: Any, room: int) -> str | None:
        if room in self.rooms:
            return f"bootstrap_room {room} is already in use on this prefill server"
        rec = PrefillRoom(req, room)
        self.rooms[room] = rec
        self.by_req[id(req)] = rec
        early = self.early.pop(room, None)
        if early is not None:
            self._on_message(early[1], time.monotonic())
        return None

    def holds(self, req: Any) -> bool:
        return id(req) in self.by_req

    @property
    def busy(self) -> bool:
        return bool(self.rooms) or bool(self.early)

    def abort(self, req: Any) -> None:
        """The prefill request was aborted (its client answered by the scheduler); decode hears `failed`."""
        rec = self.by_req.get(id(req))
        if rec is None:
            return
        rec.answered = True
        self._stop(rec, "the request was aborted on the prefill server")

    def after_extend(self, req: Any, kv_len: int, first: dict[str, Any] | None) -> None:
        """A step computed KV up to kv_len tokens of req; `first` when it sampled the first token (the end)."""
        rec = self.by_req.get(id(req))
        if rec is None or rec.error is not None:
            return
        ps = self.page_size
        ready = (kv_len + ps - 1) // ps if first is not None else kv_len // ps
        if ready > rec.pages_sent:
            src = self.host.pd_src_pages(req, ready)[rec.pages_sent:]
            dst = rec.dest["pages"][rec.pages_sent:ready]
            self._submit(rec, merge_runs(src, dst))
            rec.pages_sent = ready
        if first is not None:
            self.host.pd_detach(req)
            rec.first, rec.state, rec.since = first, "transferring", time.monotonic()
            self._maybe_finish(rec)

    # ------------------------------------------------------------------ the loop
    def poll(self) -> None:
        now = time.monotonic()
        while True:
            try:
                room_obj, nbytes, error = self.results.get_nowait()
            except queue.Empty:
                break
            rec = room_obj
            if self.rooms.get(rec.room) is not rec:
                continue  # abandoned when its decode died: nothing waits for this write any more
            rec.inflight -= 1
            rec.bytes += nbytes
            if error is not None:
                self._stop(rec, f"KV transfer to decode failed: {error}")
            else:
                self._maybe_finish(rec)
        for msg in self.channel.recv_all():
            self._on_message(msg, now)
        self._expire(now)
        self._heartbeat(now)
        self.stats.states = dict.fromkeys(STATES, 0)
        for r in self.rooms.values():
            self.stats.states[r.state] += 1

    def _on_message(self, msg: dict[str, Any], now: float) -> None:
        addr = msg.get("from")
        if not isinstance(addr, str):
            return
        kind = msg["kind"]
        room = msg.get("room")
        rec = self.rooms.get(room)
        if rec is None and room in self.ended:
            self.channel.send(addr, {"kind": "failed", "room": room, "from": self.channel.addr,
                                     "reason": self.ended[room][1]})
            return
        if rec is None:
            if kind == "cancel" and room not in self.early:  # nothing here (any more): acknowledge at once
                self.channel.send(addr, {"kind": "failed", "room": room, "from": self.channel.addr,
                                         "reason": "cancelled"})
            if kind in ("dest", "cancel") and isinstance(room, int):
                self.early[room] = (now, msg)  # the request may still come: it learns its fate then
            return
        if kind == "dest" and rec.state == "bootstrapping" and rec.dest is None:
            self._on_dest(rec, msg, now)
        elif kind == "cancel" and (rec.dest is None or rec.decode_addr == addr):
            if rec.dest is None:
                rec.dest = {"from": addr}
            self._stop(rec, "cancelled by the decode server")

    def _on_dest(self, rec: PrefillRoom, msg: dict[str, Any], now: float) -> None:
        rec.dest, rec.t_dest = msg, now
        need = (self.host.pd_prompt_len(rec.req) + self.page_size - 1) // self.page_size
        problem = None
        if msg.get("identity") != self.identity:
            problem = f"decode's KV layout {msg.get('identity')} differs from this side's {self.identity}"
        elif not isinstance(msg.get("pages"), list) or len(msg["pages"]) != need:
            problem = f"decode reserved {len(msg.get('pages') or [])} pages for a prompt of {need} pages"
        else:
            try:
                self.backend.check_peer(msg["peer"])
            except (ValueError, KeyError, TypeError) as e:
                problem = str(e)
        if problem:
            self._stop(rec, problem)
            return
        rec.state, rec.since = "prefilling", now
        self.host.pd_enqueue(rec.req)

    def _expire(self, now: float) -> None:
        for table in (self.early, self.ended):
            for room, (t, _) in list(table.items()):
                if now - t > self.bootstrap_timeout_s:
                    del table[room]
        for rec in list(self.rooms.values()):
            if rec.state == "bootstrapping" and rec.error is None and now - rec.since > self.bootstrap_timeout_s:
                self._stop(rec, f"no decode server asked for room {rec.room} within {self.bootstrap_timeout_s:g} s "
                                "(--disaggregation-bootstrap-timeout)")

    def _heartbeat(self, now: float) -> None:
        live = {r.decode_hb for r in self.rooms.values() if r.decode_hb and r.error is None}
        for hb in self.heartbeat.watch(live):
            logger.error("the decode rank with heartbeat %s sent nothing for %.1f s: dropping its transfers", hb,
                         self.heartbeat.dead_after_s)
            for rec in [r for r in self.rooms.values() if r.decode_hb == hb]:
                self.channel.forget(rec.decode_addr)
                pool = self.pools.pop(rec.decode_addr, None)
                if pool is not None:
                    pool.shutdown(wait=False, cancel_futures=True)
                # writes to a dead peer block until their timeout: do not wait for them. They only read this
                # side's pages, so freeing those now can at worst send stale bytes to the dead peer.
                rec.inflight = 0
                self._stop(rec, f"the decode server stopped answering (no heartbeat for "
                                f"{self.heartbeat.dead_after_s:g} s)", notify=False)

    # ------------------------------------------------------------------ transfers
    def _submit(self, rec: PrefillRoom, runs: list) -> None:
        rec.inflight += 1
        self.backend_sync()
        pool = self.pools.get(rec.decode_addr)
        if pool is None:
            pool = self.pools[rec.decode_addr] = ThreadPoolExecutor(TRANSFER_THREADS, thread_name_prefix="pd-transfer")
        pool.submit(self._write, rec, runs)

    def backend_sync(self) -> None:
        """The forward's KV writes must be in memory before a transfer thread reads them (CUDA is asynchronous)."""
        buf = self.backend.buffers[0] if self.backend.buffers else None
        if buf is not None and buf.is_cuda:
            import torch

            torch.cuda.current_stream(buf.device).synchronize()

    def _write(self, rec: PrefillRoom, runs: list) -> None:
        nbytes, error = 0, None
        try:
            fail = self.debug_failure_prob and self._rng.random() < self.debug_failure_prob
            if fail and self._rng.random() < 0.5:
                raise TransferError("injected before the write (--disaggregation-debug-failure-prob)")
            nbytes = self.backend.write(rec.dest["peer"], runs, self.transfer_timeout_s)
            if fail:
                raise TransferError("injected after the write (--disaggregation-debug-failure-prob)")
        except Exception as e:  # noqa: BLE001 - every failure fails this request only
            error = f"{type(e).__name__}: {e}"
        self.results.put((rec, nbytes, error))

    # ------------------------------------------------------------------ endings
    def _stop(self, rec: PrefillRoom, reason: str, notify: bool = True) -> None:
        """The transfer cannot succeed: stop prefilling; finish once the writes in flight have returned."""
        if rec.error is None:
            rec.error = reason
        rec.notify = notify
        if rec.state == "prefilling":
            self.host.pd_detach(rec.req)
        self._maybe_finish(rec)

    def _maybe_finish(self, rec: PrefillRoom) -> None:
        if rec.inflight or (rec.error is None and rec.first is None):
            return
        self.rooms.pop(rec.room, None)
        self.by_req.pop(id(rec.req), None)
        ok = rec.error is None
        self.host.pd_detach(rec.req)
        self.host.pd_release(rec.req, cache=ok)
        msg: dict[str, Any] = {"room": rec.room, "from": self.channel.addr, "bytes": rec.bytes}
        if ok:
            self.stats.on_transfer(rec.bytes, time.monotonic() - rec.t_dest)
            msg.update(kind="done", **rec.first)
        else:
            self.stats.failed += 1
            msg.update(kind="failed", reason=rec.error)
        if rec.decode_addr and rec.notify:
            self.channel.send(rec.decode_addr, msg)
        elif not ok and rec.decode_addr is None:
            self.ended[rec.room] = (time.monotonic(), rec.error)
        if not rec.answered:
            if not ok:
                logger.warning("room %d: %s", rec.room, rec.error)
            self.host.pd_finish(rec.req, rec.error)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self.heartbeat.close()
