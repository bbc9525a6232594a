"""Scheduler: continuous batching over one attention group's requests and KV pool.

Each step is either a prefill (EXTEND: new prompts, chunks of long prompts, recomputation of retracted
requests) or a decode (DECODE_LEN tokens for every running request); prefill goes first when admissible.
With --enable-mixed-chunk (SGLang's flag), a prefill that finds requests decoding runs together with them (MIXED:
the prefill requests, then every running request as a DECODE_LEN-token extend), so a long prompt does not stall the
decodes for whole prefill steps; the prefill's token budget shrinks by the decodes' tokens, as in SGLang.
Admission is by free KV pages (after evicting unlocked prefix cache) with a reserve for the running requests'
future tokens. When decode runs out of pages anyway, the newest requests are retracted: their KV is dropped and
they go back to the queue, to be recomputed later from prompt + output so far (greedy output is unchanged).

The scheduler holds no device tensors: it builds host-side batches, the model runner runs them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from typing import TYPE_CHECKING

import numpy as np
import torch

from moeserve.args import PDRole, ServerArgs
from moeserve.constrained.base import GrammarBackend, GrammarError, NoGrammarBackend
from moeserve.core.forward_batch import DECODE_LEN, ForwardBatch, ForwardMode
from moeserve.kvcache import HostKVPool, PageAllocator, make_prefix_cache
from moeserve.kvcache.req_to_token import ReqToTokenPool
from moeserve.kvcache.storage.keys import KVLayout, kv_layout_name, model_identity
from moeserve.kvcache.storage.registry import make_storage
from moeserve.kvcache.storage_tier import StorageTier
from moeserve.rank.io_struct import FinishReason, GenerateReq, LoadOut, TokenOut
from moeserve.rank.pd_host import PDHost
from moeserve.rank.prompt_logprobs import scored_positions
from moeserve.rank.request import FUTURE_TOKEN, Req
from moeserve.rank.scheduled_batch import ScheduledBatch, SchedulerStats
from moeserve.rank.step_results import StepResults

if TYPE_CHECKING:
    from moeserve.kvcache.kv_pool import KVPool
    from moeserve.rank.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Scheduler(PDHost, StepResults):
    """Owns the waiting queue, the running set, the KV page allocator, the prefix cache and the req table.

    In PD mode `self.pd` (set by the worker) holds the requests before they reach the queue (decode: until their
    KV arrived) and after their prefill (prefill: until decode has it); pd_host.py has the hooks it calls.
    """

    def __init__(self, server_args: ServerArgs, num_pages: int, context_length: int,
                 eos_token_ids: list[int], tokenizer=None, dp_rank: int = 0, grammar: GrammarBackend | None = None,
                 kv_pool: KVPool | None = None, num_draft_tokens: int = 0, draft_kv_pool: KVPool | None = None):
        """kv_pool: the model runner's device pool, which the hierarchical cache's host tier copies from and to,
        with draft_kv_pool, the speculative draft's (ModelRunner.draft_kv_pool). num_draft_tokens: speculative
        decoding's k (rank/speculative/), 0 without it."""
        self.args = server_args
        # speculative decoding (rank/speculative/): decode steps verify [t, d_1..d_k], k + 1 tokens per request
        self.num_draft_tokens = num_draft_tokens
        self.decode_len = num_draft_tokens + 1 if num_draft_tokens else DECODE_LEN
        self.dp_rank = dp_rank
        self.page_size = server_args.page_size
        self.context_length = context_length
        self.eos_token_ids = list(eos_token_ids)
        self.tokenizer = tokenizer  # for stop strings only
        self.grammar = grammar if grammar is not None else NoGrammarBackend("this rank has no grammar backend")
        self.pd_role = server_args.disagg.role  # read once: requests and steps ask it
        self.allocator = PageAllocator(num_pages, self.page_size)
        # decode gets every prompt's KV from prefill: a prefix cache there would never be hit
        no_cache = server_args.disable_radix_cache or self.pd_role is PDRole.DECODE
        self.host_pool: HostKVPool | None = None
        self.storage: StorageTier | None = None
        if server_args.enable_hierarchical_cache and not no_cache:
            assert kv_pool is not None, "the hierarchical cache needs the device KV pool"
            self.host_pool = _host_pool(server_args, kv_pool, draft_kv_pool)
            if server_args.hicache_storage_backend is not None:
                self.storage = _storage_tier(server_args, kv_pool, draft_kv_pool, self.host_pool)
        self.cache = make_prefix_cache(not no_cache, self.allocator, self.page_size, self.host_pool,
                                       server_args.hicache_write_policy, self.storage)
        self.max_running = server_args.max_running_requests
        # (a verify step near the context's end holds slots for its k drafts past it)
        self.req_table = ReqToTokenPool(self.max_running + 2, context_length + self.page_size + num_draft_tokens)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None  # a prompt partway through chunked prefill
        self.reqs: dict[str, Req] = {}
        self.pending_out: list[TokenOut] = []  # outputs produced outside a step (aborts, rejections)
        self.stats = SchedulerStats()

    @classmethod
    def for_runner(cls, server_args: ServerArgs, runner: ModelRunner, eos_token_ids: list[int] | None = None,
                   **kwargs) -> Scheduler:
        """The scheduler of runner's KV pool: its pages, context length, draft pool and k, and (unless given) the
        model's EOS ids; kwargs as __init__'s (tokenizer, dp_rank, grammar)."""
        eos = runner.config.eos_token_ids if eos_token_ids is None else eos_token_ids
        return cls(server_args, runner.num_pages, runner.context_length, eos, num_draft_tokens=runner.num_draft_tokens,
                   kv_pool=runner.kv_pool, draft_kv_pool=runner.draft_kv_pool, **kwargs)

    # ------------------------------------------------------------------ requests in
    def add_request(self, r: GenerateReq) -> None:
        req = Req.from_generate(r, self.eos_token_ids)
        if r.rid in self.reqs:
            self._reject(req, f"request id {r.rid!r} is already in use")
            return
        total = len(req.input_ids) + req.params.max_new_tokens
        if not req.input_ids:
            self._reject(req, "the prompt is empty")
            return
        if len(req.input_ids) >= self.context_length:
            self._reject(req, f"the prompt has {len(req.input_ids)} tokens; the context length is "
                              f"{self.context_length}")
            return
        if r.return_logprob and r.logprob_start_len >= len(req.input_ids):
            self._reject(req, f"logprob_start_len {r.logprob_start_len} must be less than the prompt's "
                              f"{len(req.input_ids)} tokens")
            return
        if self._pages_for(total) > self.allocator.num_pages:
            self._reject(req, f"prompt + max_new_tokens = {total} tokens does not fit the KV cache "
                              f"({self.allocator.num_pages * self.page_size} tokens)")
            return
        if req.params.max_new_tokens == 0 and not req.wants_prompt_logprobs:  # done, with no output token
            req.finish_reason = FinishReason("length")
            self.pending_out.append(req.take_output())
            return
        if req.params.grammar is not None:
            try:
                if self.pd is not None:
                    raise GrammarError("structured outputs are not supported with PD disaggregation")
                req.grammar = self.grammar.matcher(self.grammar.compile(*req.params.grammar))
            except GrammarError as e:
                self._reject(req, str(e))
                return
        if self.num_draft_tokens and (req.params.uses_penalties or req.grammar is not None):
            self._reject(req, "penalties (frequency, presence, repetition) and structured outputs are not "
                              "supported with --speculative-algorithm yet")
            return
        if self.num_draft_tokens:
            req.spec_verify_ct = 0
        if self.pd is not None and not req.asked.local:
            self._add_pd_request(req)
            return
        self.reqs[req.rid] = req
        self.waiting.append(req)

    def _add_pd_request(self, req: Req) -> None:
        r = req.asked
        if r.bootstrap_room is None or r.bootstrap_host is None or r.bootstrap_port is None:
            self._reject(req, f"this server runs --disaggregation-mode {self.pd_role.value}: a request "
                              "needs bootstrap_host, bootstrap_port and bootstrap_room (send it through "
                              "sglang-router --pd-disaggregation)")
            return
        if self.pd_role is PDRole.PREFILL:  # prefill samples the first token only
            one = dataclasses.replace(r, sampling_params=dataclasses.replace(r.sampling_params, max_new_tokens=1))
            req = Req.from_generate(one, self.eos_token_ids)  # (it scores the prompt if asked)
            error = self.pd.add(req, r.bootstrap_room)
        else:
            req.prompt_scored_elsewhere()
            error = self.pd.add(req, r.bootstrap_room, r.bootstrap_host, r.bootstrap_port)
        if error:
            self._reject(req, error)
            return
        self.reqs[req.rid] = req

    def _reject(self, req: Req, message: str) -> None:
        req.finish_reason = FinishReason("abort", message=message, status_code=400)
        self.pending_out.append(req.take_output())

    def abort(self, rid: str) -> None:
        """Drop a request wherever it is, freeing its KV; it ends with finish reason 'abort'."""
        req = self.reqs.get(rid)
        if req is None:
            return
        if self.pd is not None and self.pd.holds(req):  # its KV is freed once the peer let go of it
            req.finish_reason = FinishReason("abort", message="aborted by request")
            self.pending_out.append(req.take_output())
            del self.reqs[rid]
            self.pd.abort(req)
            return
        self.pd_detach(req)  # out of the waiting and running lists and the chunk slot
        self._release(req, cache=False)
        req.drop_future()  # a step in flight may still sample for it: that token is not sent
        req.finish_reason = FinishReason("abort", message="aborted by request")
        self.pending_out.append(req.take_output())
        del self.reqs[rid]

    def close(self) -> None:
        """Let go of what outlives a step: the host tier's copies in flight, the storage tier's connection."""
        self.cache.close()
        if self.storage is not None:
            self.storage.close()

    def flush_cache(self) -> bool:
        """Empty the prefix cache; refused (False) while requests are in flight."""
        if self.running or self.waiting or self.chunked or (self.pd is not None and self.pd.busy):
            return False
        self.cache.reset()
        return True

    # ------------------------------------------------------------------ load
    @property
    def num_used_tokens(self) -> int:
        used_pages = self.allocator.num_pages - self.allocator.num_free_pages
        return used_pages * self.page_size - self.cache.evictable_size

    def get_load(self) -> LoadOut:
        waiting_tokens = sum(len(r.fill_ids) - r.kv_len for r in self.waiting)
        if self.chunked:
            waiting_tokens += len(self.chunked.fill_ids) - self.chunked.kv_len
        pd_waiting = len(self.pd.rooms) if self.pd is not None else 0
        return LoadOut(
            dp_rank=self.dp_rank, num_running=len(self.running) + (self.chunked is not None),
            num_waiting=len(self.waiting) + pd_waiting, num_waiting_tokens=waiting_tokens,
            kv_used_tokens=self.num_used_tokens, kv_total_tokens=self.allocator.num_pages * self.page_size,
            num_cached_tokens=self.cache.total_size,
            disagg=self.pd.stats.to_json() if self.pd is not None else None,
            spec=((self.stats.spec_rounds, self.stats.spec_drafted, self.stats.spec_accepted)
                  if self.num_draft_tokens else None),
            hicache=self.host_pool.report() if self.host_pool is not None else None,
        )

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> ScheduledBatch | None:
        """Pick this step's batch: a prefill if anything can be admitted, else a decode of the running set; with
        --enable-mixed-chunk, a prefill beside running requests is a MIXED step of both."""
        if self.args.enable_mixed_chunk and self.running and (self.waiting or self.chunked):
            return self._schedule_mixed()
        batch = self._schedule_extend()
        if batch is None and self.running:
            batch = self._schedule_decode()
        return batch

    def _schedule_mixed(self) -> ScheduledBatch | None:
        """The running requests' decode slots first (they may retract: then KV is short and no prefill joins this
        step), then a prefill from what the pool has left, within the token budget less the decodes' tokens."""
        retractions = self.stats.retractions
        decodes = self._take_decode_slots()
        picked = None
        if self.stats.retractions == retractions:
            picked = self._pick_extend(reserved_tokens=len(decodes) * DECODE_LEN)
        if picked is None:
            return self._make_decode_batch(decodes) if decodes else None
        reqs, extend_lens = picked
        if not decodes:
            return self._make_batch(ForwardMode.EXTEND, reqs, extend_lens)
        return self._make_batch(ForwardMode.MIXED, reqs + decodes, extend_lens + [DECODE_LEN] * len(decodes),
                                num_decodes=len(decodes))

    def _pages_for(self, tokens: int) -> int:
        return (tokens + self.page_size - 1) // self.page_size

    def _available_pages(self) -> int:
        return self.allocator.num_free_pages + self.cache.evictable_size // self.page_size

    def _reserved_pages(self, reqs: list[Req]) -> int:
        """Pages kept back for the future tokens of running requests (decode would otherwise retract)."""
        ratio = self.args.new_token_ratio
        future = sum(max(r.params.max_new_tokens - len(r.output_ids), 0) for r in reqs)
        return self._pages_for(int(future * ratio)) + len(reqs)

    def _alloc(self, req: Req, n: int) -> list[int] | None:
        """Slots for n more tokens of req (evicting cache if needed); None if the pool cannot supply them."""
        last_slot = int(self.req_table.table[req.row, req.kv_len - 1]) if req.kv_len else -1
        need = self.allocator.pages_needed(req.kv_len, n)
        short = need - self.allocator.num_free_pages
        if short > 0:
            self.cache.evict(short * self.page_size)
        return self.allocator.extend_slots(req.kv_len, last_slot, n)

    def _schedule_extend(self) -> ScheduledBatch | None:
        picked = self._pick_extend()
        return self._make_batch(ForwardMode.EXTEND, *picked) if picked else None

    def _pick_extend(self, reserved_tokens: int = 0) -> tuple[list[Req], list[int]] | None:
        """Admit prompts (and the chunked one) within the token budget: (requests, new tokens of each), their
        slots allocated and written to the req table; None when nothing can be admitted. reserved_tokens: taken
        off the budget (a MIXED step's decodes)."""
        token_budget = min(self.args.max_prefill_tokens, self.args.chunk_size or 1 << 62) - reserved_tokens
        reqs: list[Req] = []
        extend_lens: list[int] = []
        candidates = ([self.chunked] if self.chunked else []) + self._waiting_in_order()
        self.chunked = None
        for req in candidates:
            if token_budget <= 0:
                if req.row is not None and req not in reqs:
                    self.chunked = req
                break
            is_new = req.row is None
            if is_new and (len(self.running) + len(reqs) >= self.max_running
                           or not self._acquire_row_and_prefix(req)):
                break
            remaining = len(req.fill_ids) - req.kv_len
            take = min(remaining, token_budget)
            need = self.allocator.pages_needed(req.kv_len, take)
            reserve = self._reserved_pages(self.running + reqs + [req])
            others_hold_kv = bool(reqs or self.running)
            slots = None
            if need + reserve <= self._available_pages() or not others_hold_kv:
                slots = self._alloc(req, take)
            if slots is None:  # wait until running requests finish and free pages
                if is_new:
                    self._release(req, cache=False)
                else:
                    self.chunked = req
                break
            self.req_table.write(req.row, req.kv_len, slots)
            if is_new:
                self.waiting.remove(req)
            reqs.append(req)
            extend_lens.append(take)
            token_budget -= take
            if take < remaining:
                self.chunked = req
                break
        if not reqs:
            return None
        return reqs, extend_lens

    def _waiting_in_order(self) -> list[Req]:
        if self.args.schedule_policy == "lpm":
            return sorted(self.waiting, key=lambda r: -self.cache.match_len(r.fill_ids))
        return list(self.waiting)

    def _acquire_row_and_prefix(self, req: Req) -> bool:
        """Give a new (or retracted) request a table row and its cached prefix (locked)."""
        row = self.req_table.alloc()
        if row is None:
            return False
        req.row = row
        fill = req.fill_ids
        # Keep at least one token to compute: the last prompt token's logits pick the next token.
        usable = len(fill) - 1
        if req.wants_prompt_logprobs:  # positions to score are computed, not taken from the cache
            usable = min(usable, req.next_scored_position)
        usable = usable // self.page_size * self.page_size
        match = self.cache.match_prefix(fill[:usable])
        self.cache.lock(match.node)
        req.last_node = match.node
        req.prefix_len = req.kv_len = len(match.slots)
        self.req_table.write(row, 0, match.slots)
        if req.num_retractions == 0:
            req.cached_tokens = req.prefix_len
            if self.host_pool is not None:
                req.cached_tokens_details = {"device": req.prefix_len - match.host_tokens,
                                             "host": match.host_tokens - match.storage_tokens}
                if self.args.hicache_storage_backend is not None:
                    req.cached_tokens_details["storage"] = match.storage_tokens
        return True

    def _schedule_decode(self) -> ScheduledBatch | None:
        reqs = self._take_decode_slots()
        if not reqs:
            return None
        return self._make_decode_batch(reqs)

    def _make_decode_batch(self, reqs: list[Req]) -> ScheduledBatch:
        """A decode step of reqs, their slots taken: DECODE_LEN tokens each, or with speculative decoding a verify
        step of [t, d_1..d_k] each, run as an extend of k + 1 tokens over the paged KV (the drafts are filled in
        when it launches)."""
        if self.num_draft_tokens:
            return self._make_batch(ForwardMode.EXTEND, reqs, [self.decode_len] * len(reqs),
                                    num_draft_tokens=self.num_draft_tokens)
        return self._make_batch(ForwardMode.DECODE, reqs, [DECODE_LEN] * len(reqs))

    def can_schedule_ahead(self) -> bool:
        """Whether the next step can be scheduled while the running requests' last tokens are still being sampled
        (steps.py): only when no request would have to be retracted, since a retracted request is recomputed
        from tokens the host must know."""
        need = sum(self.allocator.pages_needed(r.kv_len, self.decode_len) for r in self.running)
        return need <= self._available_pages()

    def _will_finish(self, req: Req) -> bool:
        """Its token in flight is its last (length or context): no decode slot for another one."""
        return len(req.output_ids) >= req.params.max_new_tokens or req.seq_len >= self.context_length

    def _take_decode_slots(self) -> list[Req]:
        """A KV slot for the next token of every running request (written to the req table), retracting requests
        while the pool is short; the requests that got one, shortest first. A request whose token in flight
        finishes it by length gets none."""
        reqs = sorted((r for r in self.running if not (r.num_future and self._will_finish(r))),
                      key=lambda r: r.seq_len)  # shortest first: retract the longest last-in
        while True:
            for req in list(reqs):
                if req.kv_len >= len(req.fill_ids):
                    continue  # took its slots in an earlier pass of this loop
                slots = self._alloc(req, self.decode_len)
                if slots is None:
                    victim = self._retract_one(reqs)
                    if victim is None:
                        raise RuntimeError("the KV pool cannot hold a single request; raise --max-total-tokens")
                    reqs.remove(victim)
                    break
                self.req_table.write(req.row, req.kv_len, slots)
                req.kv_len += self.decode_len  # provisional: the slots now belong to the tokens this step computes
            else:
                break
        for req in reqs:
            req.kv_len -= self.decode_len  # _make_batch counts this step's tokens as new
        return reqs

    def _retract_one(self, reqs: list[Req]) -> Req | None:
        """Drop the KV of the request with the fewest generated tokens; it goes back to the front of the queue."""
        if len(reqs) <= 1:
            return None
        victim = min(reqs, key=lambda r: len(r.output_ids))  # the least generated: the least work lost
        assert not victim.num_future, "retraction with tokens in flight (steps.py resolves them first)"
        self.running.remove(victim)
        self._release(victim, cache=False)
        victim.num_retractions += 1
        self.waiting.appendleft(victim)
        self.stats.retractions += 1
        logger.info("KV pool full: retracted request %s (%d tokens) for recomputation",
                    victim.rid, victim.seq_len)
        return victim

    def _make_batch(self, mode: ForwardMode, reqs: list[Req], extend_lens: list[int],
                    num_decodes: int = 0, num_draft_tokens: int = 0) -> ScheduledBatch:
        input_ids: list[int] = []
        seq_lens, rows = [], []
        out_loc_parts = []
        finishes = []
        prompt_reqs, prompt_counts, prompt_targets, prompt_rows = [], [], [], []  # rows that score prompt tokens
        offset = 0
        for req, n in zip(reqs, extend_lens, strict=True):
            fill = req.fill_ids
            if mode.is_extend and req.wants_prompt_logprobs:
                scored = scored_positions(req.next_scored_position, len(req.input_ids), req.kv_len, n)
                if len(scored):
                    prompt_rows.extend(offset + p - req.kv_len for p in scored)
                    prompt_reqs.append(req)
                    prompt_counts.append(len(scored))
                    prompt_targets.extend(fill[scored.start + 1 : scored.stop + 1])
                    req.next_scored_position = scored.stop
            offset += n
            known = fill[req.kv_len : req.kv_len + n]  # a verify step: [t], its drafts come at launch
            input_ids.extend(known)
            input_ids.extend([FUTURE_TOKEN] * (n - len(known)))
            out_loc_parts.append(self.req_table.table[req.row, req.kv_len : req.kv_len + n])
            req.kv_len += n
            seq_lens.append(req.kv_len)
            rows.append(req.row)
            finishes.append(req.kv_len == len(fill) or num_draft_tokens > 0)
        kv_indices = self.req_table.gather(rows, seq_lens)
        fb = ForwardBatch.build(mode, input_ids, seq_lens, extend_lens,
                                np.concatenate(out_loc_parts), kv_indices, num_decodes=num_decodes)
        samples = [f and r.samples for r, f in zip(reqs, finishes, strict=True)]
        fb.logits_indices = fb.logits_indices[torch.tensor(samples, dtype=torch.bool)]
        if prompt_rows:
            fb.logits_indices = torch.cat([torch.tensor(prompt_rows, dtype=torch.int64), fb.logits_indices])
        if mode.is_decode or num_decodes:  # the decodes' cache rows as one padded block (a MIXED step's tail)
            tail = slice(len(rows) - (num_decodes or len(rows)), len(rows))
            fb.decode_slots = torch.from_numpy(self.req_table.table[rows[tail], : max(seq_lens[tail])])
        return ScheduledBatch(mode, reqs, extend_lens, fb, finishes, prompt_reqs, prompt_counts, prompt_targets,
                              num_draft_tokens)

    def trim_kv(self, req: Req, kv_len: int) -> None:
        """Give back the request's KV past its first kv_len tokens (a verify step's rejected drafts, or tokens
        after a stop inside the accepted run): freed, never cached."""
        if req.kv_len <= kv_len:
            return
        self.allocator.free_slots(self.req_table.table[req.row, kv_len : req.kv_len].tolist())
        req.kv_len = kv_len

    def _release(self, req: Req, cache: bool) -> None:
        """Return the request's KV: into the prefix cache (finished requests) or straight to the free list.
        With speculative decoding the cache keeps only the positions whose draft KV the target's hidden states
        wrote (before req.draft_start, rank/speculative/round.py): past them the draft pool holds the draft steps'
        scratch, or nothing of this request (a prompt that never drafted), and a later hit would draft from it."""
        if req.row is None:
            return
        if cache and self.num_draft_tokens:
            self.trim_kv(req, max(req.prefix_len, min(req.kv_len, req.draft_start)))
        slots = self.req_table.table[req.row, : req.kv_len]
        self.cache.release(req.fill_ids, slots, req.prefix_len, req.last_node, keep=cache)
        req.last_node = None
        req.prefix_len = 0
        req.kv_len = 0
        self.req_table.free(req.row)
        req.row = None


def _host_pool(args: ServerArgs, kv_pool: KVPool, draft_pool: KVPool | None) -> HostKVPool:
    """The hierarchical cache's host pool: --hicache-size GB, else --hicache-ratio times the device pool; its pages
    hold the draft's KV too where speculative decoding has a pool of its own."""
    pages = HostKVPool.num_pages_for(kv_pool, args.hicache_ratio, args.hicache_size, draft_pool)
    pool = HostKVPool(kv_pool, pages, draft_pool)
    logger.info("hierarchical cache: host KV pool of %d tokens (%.2f GiB%s), %s", pool.num_pages * pool.page_size,
                pool.total_bytes / (1 << 30), ", pinned" if kv_pool.device.type == "cuda" else "",
                args.hicache_write_policy)
    return pool


def _storage_tier(args: ServerArgs, kv_pool: KVPool, draft_pool: KVPool | None, host: HostKVPool) -> StorageTier:
    """--hicache-storage-backend over the host pool, its keys rooted in the model's identity and the pool's layout
    (pages of another model, dtype, page size or weights' load, or with the draft's KV or without, are never read)."""
    load = f"load_format={args.load_format} quantization={args.quantization}"
    if args.load_format == "dummy":
        load += f" seed={args.random_seed}"
    if draft_pool is not None:  # the draft's layer (its own checkpoint or the target's MTP) and its KV layout
        draft = args.speculative_draft_model_path
        load += f" draft={model_identity(draft) if draft else 'mtp'} {kv_layout_name(draft_pool)}"
    assert args.model_path is not None  # the model runner resolved it
    layout = KVLayout.of_pool(kv_pool, model_identity(args.model_path), extra=load)
    backend = make_storage(args.hicache_storage_backend, args.hicache_storage_backend_extra_config)
    logger.info("hierarchical cache: storage tier %s (%s), prefetch %s", args.hicache_storage_backend,
                type(backend).__name__, args.hicache_storage_prefetch_policy)
    return StorageTier(backend, host, layout.root(), args.hicache_storage_prefetch_policy)
