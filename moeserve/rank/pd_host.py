"""The scheduler's side of PD disaggregation: what it does for disagg/decode.py's and disagg/prefill.py's state
machines (reserve and free pages, queue and detach requests, answer them), and building them for a rank."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from moeserve.args import ServerArgs
from moeserve.disagg.control import ControlChannel, advertised_host
from moeserve.disagg.decode import DecodeRooms
from moeserve.disagg.group import RankGroup
from moeserve.disagg.liveness import Heartbeat
from moeserve.disagg.messages import pack_tensor, unpack_tensor
from moeserve.disagg.prefill import PrefillRooms
from moeserve.disagg.transfer.base import TransferBackend
from moeserve.disagg.transfer.registry import backend_class
from moeserve.kvcache.kv_pool import kv_buffers
from moeserve.rank.io_struct import FinishReason
from moeserve.rank.request import Req

if TYPE_CHECKING:
    from moeserve.core.model_config import ModelConfig
    from moeserve.kvcache.kv_pool import KVPool
    from moeserve.rank.rank_sync import RankSync

logger = logging.getLogger(__name__)


class PDHost:
    """Mixed into Scheduler: `self.pd` is None outside PD mode, else the side's rooms."""

    pd: DecodeRooms | PrefillRooms | None = None

    # ------------------------------------------------------------------ decode
    def pd_reserve(self, req: Req) -> list[int] | None:
        """A slot and pages for the prompt's KV, if the pool can spare them beside the running requests' needs."""
        held = self.running + self.pd.reserved_reqs()
        if len(held) >= self.max_running:
            return None
        n = len(req.input_ids)
        need = self._pages_for(n)
        if held and need + self._reserved_pages(held + [req]) > self._available_pages():
            return None
        row = self.req_table.alloc()
        if row is None:
            return None
        slots = self.allocator.extend_slots(0, -1, n)
        if slots is None:
            self.req_table.free(row)
            return None
        req.row, req.prefix_len, req.kv_len = row, 0, n
        self.req_table.write(row, 0, slots)
        return [s // self.page_size for s in slots[:: self.page_size]]

    def pd_activate(self, req: Req, done: dict[str, Any]) -> None:
        """The prompt's KV arrived with prefill's sampled tokens: the request decodes from here."""
        tokens = [int(t) for t in done["tokens"]]
        req.output_ids.extend(tokens)
        kept = self._check_finish(req, len(tokens))
        if req.asked.return_logprob:
            req.logprobs.extend((done.get("logprobs") or [None] * kept)[:kept])
            req.top_logprobs.extend([tuple(x) for x in top] for top in (done.get("top_logprobs") or [[]] * kept)[:kept])
        req.cached_tokens = int(done.get("cached_tokens", 0))
        req.cached_tokens_details = done.get("cached_tokens_details")  # prefill's hierarchical cache, by tier
        if done.get("draft_hidden") is not None:  # speculative decoding (both sides: the bootstrap checks it):
            # the first draft extend reads (x_L, h_{L-1}) at position L - 1 (speculative/round.py)
            req.draft_start, req.draft_hidden = req.kv_len - 1, unpack_tensor(done["draft_hidden"])
        self.stats.generated += kept
        if req.finished:
            self._release(req, cache=False)
            self.reqs.pop(req.rid, None)
            self.pending_out.append(req.take_output())
            return
        self.running.append(req)
        if req.asked.stream:
            self.pending_out.append(req.take_output())

    def pd_fail(self, req: Req, message: str, status: int) -> None:
        req.finish_reason = FinishReason("abort", message=message, status_code=status)
        self.pending_out.append(req.take_output())
        self.reqs.pop(req.rid, None)

    # ------------------------------------------------------------------ prefill
    def pd_enqueue(self, req: Req) -> None:
        self.waiting.append(req)

    def pd_detach(self, req: Req) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None

    def pd_src_pages(self, req: Req, num_pages: int) -> list[int]:
        ps = self.page_size
        return (self.req_table.table[req.row, : num_pages * ps : ps] // ps).tolist()

    def pd_release(self, req: Req, cache: bool = False) -> None:
        self._release(req, cache=cache)

    def pd_finish(self, req: Req, error: str | None) -> None:
        if error is not None:
            req.finish_reason = FinishReason("abort", message=error, status_code=503)
        self.pending_out.append(req.take_output())
        self.reqs.pop(req.rid, None)

    def pd_prompt_len(self, req: Req) -> int:
        return len(req.input_ids)

    @staticmethod
    def pd_first(req: Req) -> dict[str, Any]:
        """What decode needs of the prefill's sampled tokens (their logprobs: lists as long, or None); with
        speculative decoding also h_{L-1} [1, H], the hidden state its first draft reads (round.draft_prompt)."""
        first = {"tokens": list(req.output_ids), "cached_tokens": req.cached_tokens,
                 "cached_tokens_details": req.cached_tokens_details,
                 "logprobs": list(req.logprobs) or None, "top_logprobs": list(req.top_logprobs) or None}
        if req.draft_hidden is not None:
            first["draft_hidden"] = pack_tensor(req.draft_hidden)
        return first


def make_pd_rooms(args: ServerArgs, kv_pool: KVPool, config: ModelConfig, scheduler: PDHost, dp_rank: int,
                  sync: RankSync | None = None, draft_pool: KVPool | None = None) -> DecodeRooms | PrefillRooms:
    """The PD state machine of one rank of an attention group, over its KV pool (and the draft model's, with
    speculative decoding: its buffers after the target's, written at the same pages). The group's leader also
    gets the control socket and the heartbeat, and (prefill) registers with its server's bootstrap server; with
    attention TP the group's ranks first share their transfer endpoints (group.py)."""
    from moeserve.disagg.bootstrap import register_rank

    peer_host = args.dist_init_addr.rpartition(":")[0] if args.nnodes > 1 else None
    host = advertised_host(args.host, peer_host)
    buffers = kv_buffers(kv_pool) + (kv_buffers(draft_pool) if draft_pool is not None else [])
    backend = backend_class(args.disagg.transfer_backend)(
        buffers, args.page_size, host=host, api_key=args.api_key, ib_device=args.disagg.ib_device)
    decode = args.disagg.is_decode
    group = _rank_group(backend, decode, sync)
    channel = heartbeat = None
    if group.leader:
        channel = ControlChannel(args.host, host, args.api_key)
        heartbeat = Heartbeat(args.host, host, args.api_key, args.disagg.heartbeat_interval,
                              args.disagg.heartbeat_timeout)
    replicated = config.is_mla  # the latent is the same on every attention-TP rank; GQA's heads are split
    # (the draft's KV pool is buffers of its own: "speculative" is named before the page bytes it changes)
    identity = {"architecture": config.architecture, "num_layers": config.num_hidden_layers,
                "speculative": draft_pool is not None, "page_size": args.page_size,
                "page_bytes": backend.page_bytes, "backend": args.disagg.transfer_backend}
    if not replicated:
        identity = {"attn_tp_size": group.size, **identity}
    if decode:
        rooms: DecodeRooms | PrefillRooms = DecodeRooms(
            scheduler, backend, channel, heartbeat, identity, args.api_key, args.disagg.bootstrap_timeout,
            args.disagg.waiting_timeout, args.disagg.transfer_timeout, group=group,
            ahead_pages=-(-args.max_prefill_tokens // args.page_size))  # what one prefill batch can start
    else:
        rooms = PrefillRooms(scheduler, backend, channel, heartbeat, identity, args.page_size,
                             args.disagg.bootstrap_timeout, args.disagg.transfer_timeout,
                             debug_failure_prob=args.disagg.debug_failure_prob,
                             seed=args.random_seed + dp_rank * group.size + group.rank, group=group,
                             kv_replicated=replicated, waiting_timeout_s=args.disagg.waiting_timeout)
        if group.leader:
            node0 = peer_host if args.node_rank > 0 else ("127.0.0.1" if args.host in ("0.0.0.0", "::", "")
                                                          else args.host)
            register_rank(node0, args.disagg.bootstrap_port,
                          {"dp_rank": dp_rank, "addr": channel.addr, "hb": heartbeat.addr, "identity": identity},
                          args.api_key)
    logger.info("PD %s rank %d/%d of DP group %d: %s backend, %d KV buffers%s", args.disagg.role.value,
                group.rank, group.size, dp_rank, backend.name, len(buffers),
                f", control {channel.addr}" if channel else "")
    return rooms


def _rank_group(backend: TransferBackend, decode: bool, sync: RankSync | None) -> RankGroup:
    """This rank's place in its attention-TP group; the leader's window token and (decode) every rank's endpoint,
    shared over the group's CPU group."""
    endpoint = backend.endpoint() if decode else None
    if sync is None or sync.group_size == 1:
        return RankGroup(endpoints=[endpoint] if decode else [])
    mine = RankGroup(sync.state.attn_tp_rank, sync.group_size)
    parts = sync.gather_group((mine.token, endpoint))
    return RankGroup(mine.rank, mine.size, parts[0][0], [p[1] for p in parts] if decode else [])
