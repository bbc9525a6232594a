"""The prefill side of PD disaggregation: per-request states from arrival until decode has the prompt's KV.

    bootstrapping --`dest` from decode--> prefilling --last chunk sampled--> transferring --all writes back--> done
         |                                    |                                  |
         +--- timeout / cancel / abort -------+------ write failed, `cancel`, abort, dead decode ----> failed

bootstrapping: the request waits (outside the scheduler's queue, holding no KV) for decode to say where to write:
at most --disaggregation-bootstrap-timeout for decode to ask for the room (`wait`), then while decode's heartbeat
is heard, at most --disaggregation-waiting-timeout (decode's queue is not timed by this clock). prefilling: the scheduler runs the prompt (chunked prefill, the radix
cache's prefix); `started` tells decode when the first chunk is done; after each chunk the pages that are complete are written to decode (page-aligned; the partial
last page goes with the last chunk). transferring: the first token is sampled, the last writes are in flight.
The request keeps its KV until every write it started has returned, then it goes to the radix cache (done) or
back to the pool (failed); only then does decode hear `done` (with the sampled tokens, their logprobs and
cached_tokens) or `failed`. Writes run on a pool of transfer threads; the scheduler's thread never waits on one.

With attention TP every rank of the group runs this machine on the same events (group.py): the leader collects
control messages, dead peers and the clock; each rank collects its own writes' results (`collect`), and every rank
applies all of them in the same order (`apply`). MLA: the leader reads the latent and writes it to every decode
rank (`dest` names them all). GQA: rank r writes its KV heads to decode rank r.
"""

from __future__ import annotations

import logging
import queue
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from moeserve.core.background_thread import keep_caller_threads, single_threaded_torch
from moeserve.disagg.control import ControlChannel
from moeserve.disagg.group import RankGroup
from moeserve.disagg.liveness import Heartbeat
from moeserve.disagg.stats import TransferStats
from moeserve.disagg.transfer.base import PageRun, TransferBackend, TransferError, merge_runs

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
    seq: int  # this room's number on this side, the same on every rank of the group
    since: float
    state: str = "bootstrapping"
    dest: dict[str, Any] | None = None
    waited: dict[str, Any] | None = None  # decode's `wait`: the room is queued there
    pages_sent: int = 0
    inflight: int = 0  # writes started by the group's ranks and not returned yet
    bytes: int = 0
    first: dict[str, Any] | None = None  # sampled tokens, logprobs, cached_tokens (after the last chunk)
    error: str | None = None  # set once the transfer cannot succeed; finalized when inflight reaches 0
    answered: bool = False  # the prefill request was answered already (the client aborted it)
    notify: bool = True  # tell decode how it ended (not when decode is dead)
    t_dest: float = 0.0  # when decode's `dest` came: the transfer's latency counts from here

    @property
    def decode_addr(self) -> str | None:
        peer = self.dest or self.waited
        return peer["from"] if peer else None

    @property
    def decode_hb(self) -> str | None:
        return (self.dest or self.waited or {}).get("hb")


class PrefillRooms:
    """The prefill side's PD requests of one attention group, driven by the scheduler's loop (poll, or collect and
    apply on every rank). channel and heartbeat: the leader's; None on the other ranks.
    kv_replicated: every rank holds the whole KV (MLA's latent), so the leader alone reads and writes it."""

    def __init__(self, host: PrefillHost, backend: TransferBackend, channel: ControlChannel | None,
                 heartbeat: Heartbeat | None, identity: dict[str, Any], page_size: int, bootstrap_timeout_s: float,
                 transfer_timeout_s: float, debug_failure_prob: float = 0.0, seed: int = 0,
                 group: RankGroup | None = None, kv_replicated: bool = True, waiting_timeout_s: float = 60.0):
        self.host = host
        self.backend = backend
        self.channel = channel
        self.identity = identity
        self.page_size = page_size
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.waiting_timeout_s = waiting_timeout_s
        self.heartbeat = heartbeat
        self.debug_failure_prob = debug_failure_prob
        self.group = group or RankGroup()
        self.kv_replicated = kv_replicated
        self._rng = random.Random(seed)
        self.rooms: dict[int, PrefillRoom] = {}
        self.by_req: dict[int, PrefillRoom] = {}
        self.by_seq: dict[int, PrefillRoom] = {}
        self._seq = 0
        self.now = time.monotonic()  # the leader's clock, as of the last events applied
        self.early: dict[int, tuple[float, dict[str, Any]]] = {}  # room -> (arrival, dest or cancel) before the req
        # rooms that ended before decode's `dest` came (aborted, timed out): decode hears `failed` when it comes
        self.ended: dict[int, tuple[float, str]] = {}
        self.pools: dict[str, ThreadPoolExecutor] = {}  # decode control address -> its transfer threads
        self.results: queue.SimpleQueue = queue.SimpleQueue()  # this rank's writes: (seq, bytes, error, seconds)
        self.stats = TransferStats("prefill", STATES)

    @property
    def leader(self) -> bool:
        return self.group.leader

    @property
    def writers(self) -> int:
        """Ranks of the group that write each chunk: the leader (replicated KV), or every rank its heads."""
        return 1 if self.kv_replicated else self.group.size

    @property
    def gathers(self) -> bool:
        """Whether the other ranks' write results must be gathered each step (they write too)."""
        return self.writers > 1

    # ------------------------------------------------------------------ in
    def add(self, req: Any, room: int) -> str | None:
        if room in self.rooms:
            return f"bootstrap_room {room} is already in use on this prefill server"
        self._seq += 1
        rec = PrefillRoom(req, room, self._seq, self.now)
        self.rooms[room] = rec
        self.by_req[id(req)] = rec
        self.by_seq[rec.seq] = rec
        early = self.early.pop(room, None)
        if early is not None:
            self._on_message(early[1], self.now)
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
        self._stop(rec, "the request was aborted on the prefill server", "aborted")

    def after_extend(self, req: Any, kv_len: int, first: dict[str, Any] | None) -> None:
        """A step computed KV up to kv_len tokens of req; `first` when it sampled the first token (the end)."""
        rec = self.by_req.get(id(req))
        if rec is None or rec.error is not None:
            return
        ps = self.page_size
        ready = (kv_len + ps - 1) // ps if first is not None else kv_len // ps
        if rec.state == "prefilling" and rec.pages_sent == 0 < ready:
            self._send(rec.decode_addr, {"kind": "started", "room": rec.room})
        if ready > rec.pages_sent:
            src = self.host.pd_src_pages(req, ready)[rec.pages_sent:]
            dst = rec.dest["pages"][rec.pages_sent:ready]
            self._submit(rec, merge_runs(src, dst))
            rec.pages_sent = ready
        if first is not None:
            self.host.pd_detach(req)
            rec.first, rec.state, rec.since = first, "transferring", self.now
            self._maybe_finish(rec)

    # ------------------------------------------------------------------ the loop
    def poll(self) -> None:
        """One rank alone: collect and apply."""
        self.apply([self.collect()])

    def collect(self) -> dict[str, Any]:
        """What happened on this rank since the last call: its writes' results; on the leader also the control
        messages, the peers found dead and the clock."""
        results = []
        while True:
            try:
                results.append(self.results.get_nowait())
            except queue.Empty:
                break
        if not self.leader:
            return {"results": results}
        live = {r.decode_hb for r in self.rooms.values() if r.decode_hb and r.error is None}
        return {"results": results, "now": time.monotonic(), "msgs": self.channel.recv_all(),
                "dead": self.heartbeat.watch(live)}

    def apply(self, parts: list[dict[str, Any]]) -> None:
        """Every rank: the leader's events (parts[0]) and every rank's write results, in the same order."""
        ev = parts[0]
        self.now = now = ev["now"]
        for part in parts:
            for seq, nbytes, error, seconds in part["results"]:
                self.stats.write_seconds += seconds
                rec = self.by_seq.get(seq)
                if rec is None:
                    continue  # abandoned when its decode died: nothing waits for this write any more
                rec.inflight -= 1
                rec.bytes += nbytes
                if error is not None:
                    self._stop(rec, f"KV transfer to decode failed: {error}", "write_failed")
                else:
                    self._maybe_finish(rec)
        for msg in ev["msgs"]:
            self._on_message(msg, now)
        self._expire(now)
        self._on_dead(ev["dead"])
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
            self._send(addr, {"kind": "failed", "room": room, "reason": self.ended[room][1]})
            return
        if rec is None:
            if kind == "cancel" and room not in self.early:  # nothing here (any more): acknowledge at once
                self._send(addr, {"kind": "failed", "room": room, "reason": "cancelled"})
            if kind in ("wait", "dest", "cancel") and isinstance(room, int):
                self.early[room] = (now, msg)  # the request may still come: it learns its fate then
            return
        if kind == "wait" and rec.state == "bootstrapping" and rec.dest is None and rec.waited is None:
            rec.waited, rec.since = msg, now
        elif kind == "dest" and rec.state == "bootstrapping" and rec.dest is None:
            self._on_dest(rec, msg, now)
        elif kind == "cancel" and (rec.decode_addr is None or rec.decode_addr == addr):
            if rec.dest is None:
                rec.dest = {"from": addr}
            self._stop(rec, "cancelled by the decode server", "cancelled")

    def _on_dest(self, rec: PrefillRoom, msg: dict[str, Any], now: float) -> None:
        rec.dest, rec.t_dest = msg, now
        need = (self.host.pd_prompt_len(rec.req) + self.page_size - 1) // self.page_size
        peers = msg.get("peers")
        problem = None
        if msg.get("identity") != self.identity:
            problem = f"decode's KV layout {msg.get('identity')} differs from this side's {self.identity}"
        elif not isinstance(msg.get("pages"), list) or len(msg["pages"]) != need:
            problem = f"decode reserved {len(msg.get('pages') or [])} pages for a prompt of {need} pages"
        elif not isinstance(peers, list) or not peers:
            problem = "decode's `dest` names no transfer endpoint"
        elif not self.kv_replicated and len(peers) != self.group.size:
            problem = (f"GQA's KV heads are split over attention-TP ranks: {self.group.size} here, {len(peers)} on "
                       "the decode server; run both with the same attention TP size")
        else:
            try:
                for peer in peers:
                    self.backend.check_peer(peer)
            except (ValueError, KeyError, TypeError) as e:
                problem = str(e)
        if problem:
            self._stop(rec, problem, "bad_dest")
            return
        rec.state, rec.since = "prefilling", now
        self.host.pd_enqueue(rec.req)

    def _expire(self, now: float) -> None:
        for table in (self.early, self.ended):
            for room, (t, _) in list(table.items()):
                if now - t > self.bootstrap_timeout_s:
                    del table[room]
        for rec in list(self.rooms.values()):
            if rec.state != "bootstrapping" or rec.error is not None:
                continue
            if rec.waited is None and now - rec.since > self.bootstrap_timeout_s:
                self._stop(rec, f"no decode server asked for room {rec.room} within {self.bootstrap_timeout_s:g} s "
                                "(--disaggregation-bootstrap-timeout)", "bootstrap_timeout")
            elif rec.waited is not None and now - rec.since > self.waiting_timeout_s:
                self._stop(rec, f"decode queued room {rec.room} for over {self.waiting_timeout_s:g} s "
                                "(--disaggregation-waiting-timeout)", "waiting_timeout")

    def _on_dead(self, dead: list[str]) -> None:
        for hb in dead:
            if self.leader:
                logger.error("the decode rank with heartbeat %s went silent: dropping its transfers", hb)
            for rec in [r for r in self.rooms.values() if r.decode_hb == hb]:
                if self.channel is not None:
                    self.channel.forget(rec.decode_addr)
                pool = self.pools.pop(rec.decode_addr, None)
                if pool is not None:
                    pool.shutdown(wait=False, cancel_futures=True)
                # writes to a dead peer block until their timeout: do not wait for them. They only read this
                # side's pages, so freeing those now can at worst send stale bytes to the dead peer.
                rec.inflight = 0
                self._stop(rec, "the decode server stopped answering (no heartbeat within "
                                "--disaggregation-heartbeat-timeout)", "peer_dead", notify=False)

    # ------------------------------------------------------------------ transfers
    def _submit(self, rec: PrefillRoom, runs: list[PageRun]) -> None:
        rec.inflight += self.writers
        if self.group.rank >= self.writers:
            return  # the leader writes the replicated KV for the group
        peers = rec.dest["peers"] if self.kv_replicated else [rec.dest["peers"][self.group.rank]]
        self.backend_sync()
        pool = self.pools.get(rec.decode_addr)
        if pool is None:
            keep_caller_threads()  # (core/background_thread.py)
            pool = self.pools[rec.decode_addr] = ThreadPoolExecutor(TRANSFER_THREADS, thread_name_prefix="pd-transfer",
                                                                initializer=single_threaded_torch)
        pool.submit(self._write, rec.seq, peers, runs)

    def backend_sync(self) -> None:
        """The forward's KV writes must be in memory before a transfer thread reads them (CUDA is asynchronous)."""
        buf = self.backend.buffers[0] if self.backend.buffers else None
        if buf is not None and buf.is_cuda:
            import torch

            torch.cuda.current_stream(buf.device).synchronize()

    def _write(self, seq: int, peers: list[dict[str, Any]], runs: list[PageRun]) -> None:
        nbytes, error = 0, None
        start = time.monotonic()
        try:
            fail = self.debug_failure_prob and self._rng.random() < self.debug_failure_prob
            if fail and self._rng.random() < 0.5:
                raise TransferError("injected before the write (--disaggregation-debug-failure-prob)")
            for peer in peers:
                nbytes += self.backend.write(peer, runs, self.transfer_timeout_s)
            if fail:
                raise TransferError("injected after the write (--disaggregation-debug-failure-prob)")
        except Exception as e:  # noqa: BLE001 - every failure fails this request only
            error = f"{type(e).__name__}: {e}"
        self.results.put((seq, nbytes, error, time.monotonic() - start))

    # ------------------------------------------------------------------ endings
    def _send(self, addr: str, msg: dict[str, Any]) -> None:
        """The leader sends; the other ranks only keep the state."""
        if self.channel is not None:
            self.channel.send(addr, {**msg, "from": self.channel.addr})

    def _stop(self, rec: PrefillRoom, reason: str, cause: str, notify: bool = True) -> None:
        """The transfer cannot succeed: stop prefilling; finish once the writes in flight have returned. Logged
        once (by the leader) and counted by cause."""
        if rec.error is None:
            rec.error = reason
            if self.leader:
                logger.log(logging.INFO if cause in ("aborted", "cancelled") else logging.WARNING,
                           "room %d failed (%s): %s", rec.room, cause, reason)
            self.stats.on_failure(cause)
        rec.notify = notify
        if rec.state == "prefilling":
            self.host.pd_detach(rec.req)
        self._maybe_finish(rec)

    def _maybe_finish(self, rec: PrefillRoom) -> None:
        if rec.inflight or (rec.error is None and rec.first is None):
            return
        self.rooms.pop(rec.room, None)
        self.by_req.pop(id(rec.req), None)
        self.by_seq.pop(rec.seq, None)
        ok = rec.error is None
        self.host.pd_detach(rec.req)
        self.host.pd_release(rec.req, cache=ok)
        msg: dict[str, Any] = {"room": rec.room, "bytes": rec.bytes}
        if ok:
            self.stats.on_transfer(rec.bytes, time.monotonic() - rec.t_dest)
            msg.update(kind="done", **rec.first)
        else:
            msg.update(kind="failed", reason=rec.error)
        if rec.decode_addr and rec.notify:
            self._send(rec.decode_addr, msg)
        elif not ok and rec.decode_addr is None:
            self.ended[rec.room] = (self.now, rec.error)
        if not rec.answered:
            self.host.pd_finish(rec.req, rec.error)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        if self.heartbeat is not None:
            self.heartbeat.close()
