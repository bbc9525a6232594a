"""Scheduler steps on one rank: launch (schedule's batch -> forward -> sample on the device) and resolve (the
sampled tokens to the host -> the scheduler), back to back or with one step in flight (overlap scheduling).

Overlap (SGLang's overlap scheduler; off with --disable-overlap-schedule): while the device runs decode step N,
the host resolves step N-1 (its tokens, finished requests, outputs) and schedules and launches step N+1. Step N+1
is scheduled before step N's tokens are known: each request's sampled tokens are a FUTURE_TOKEN in its output until
resolved (request.py), and the next step's input ids take them from a device table, DECODE_LEN tokens per request
row, which every sampling writes. A request that finishes at step N is in step N+1 too; those tokens are dropped
(the scheduler gives no slot to a request whose tokens in flight end it by length). The device stream orders
everything: step N+1's KV writes and its reads of the table come after step N's.

What stays back to back (the step is resolved before the next is scheduled, or right after its launch):
  - steps other than DECODE (prefills and mixed steps: their requests join the running set when resolved);
  - steps whose sampling has penalties (the next step's sampling would read the token counts) or a grammar (the
    next step's token mask needs this step's tokens in the matcher: constrained steps are not overlapped); a step's
    logprobs travel to the host with its tokens;
  - a step whose scheduling might retract a request (recomputation needs its tokens): Scheduler.can_schedule_ahead;
  - an attention TP group of several ranks (the leader's tokens are shared on the host), and the expert
    distribution recorder and rebalancer (they act between passes on host state): overlap is off for the server.
Several ranks of one rank per attention group (DP attention) overlap: each step's header (run_step) is exchanged on
the host while the device runs the step before, and a rank with nothing to run joins the MoE collectives with an
IDLE batch, so every rank runs one forward per step in the same order.
With PD disaggregation the decode side overlaps its decode steps (a request joins the running set once its KV and
first token arrived: nothing of it is in flight before); a prefill server's steps are prefills, never in flight.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moeserve.args import PDRole
from moeserve.core.forward_batch import DECODE_LEN, ForwardBatch, ForwardMode
from moeserve.rank.io_struct import TokenOut
from moeserve.rank.sampler import SampleOutput
from moeserve.rank.scheduled_batch import ScheduledBatch

if TYPE_CHECKING:
    from moeserve.rank.model_runner import ModelRunner
    from moeserve.rank.rank_sync import RankSync, StepHeader
    from moeserve.rank.request import Req
    from moeserve.rank.scheduler import Scheduler
    from moeserve.rank.speculative.round import RoundResult

logger = logging.getLogger(__name__)


@dataclass
class LaunchedStep:
    """A step whose device work is queued; its sampled tokens may still be on their way to the host."""

    batch: ScheduledBatch
    out: SampleOutput | None  # None when nothing samples (or a verify step: `round`)
    host: dict[str, torch.Tensor] | None = None  # out.device's tensors, pinned, filled by async copies
    copied: torch.cuda.Event | None = None  # recorded after those copies
    round: RoundResult | None = None  # a verify step's accepted tokens (speculative decoding), on the host

    @property
    def in_flight(self) -> bool:
        return self.host is not None


def launch_step(scheduler: Scheduler, runner: ModelRunner, batch: ScheduledBatch,
                tokens: torch.Tensor | None = None, keep_on_device: bool = False) -> LaunchedStep:
    """Forward and sample `batch`. tokens: the device table of each request row's last sampled tokens (overlap):
    future input ids are read from it and the sampled tokens written to it. keep_on_device: leave the tokens on
    the device and start their copy to the host (the caller checked the step may stay in flight)."""
    fb = batch.forward
    scheduler.stats.launched = batch.mode
    spec = runner.speculative
    if batch.is_verify:  # the decode step of speculative decoding (its step times and log line are decode's)
        scheduler.stats.launched = ForwardMode.DECODE
        result = spec.run(scheduler, batch)
        for r in batch.reqs:
            r.add_future()
        scheduler.stats.add_round(result.num_accepted, spec.k)
        return LaunchedStep(batch, None, round=result)
    if tokens is not None:
        fb = _with_known_inputs(fb, batch, tokens, runner.device)
    if spec is not None:  # the draft model reads the target's hidden states
        logits, hidden = runner.forward_hidden(fb)
        spec.after_extend(batch, hidden)
    else:
        logits = runner.forward(fb)
    if batch.num_prompt_rows:  # the first rows score prompt tokens (prompt_logprobs.py), the rest sample
        scheduler.add_prompt_logprobs(batch, *runner.score_prompt(logits[:batch.num_prompt_rows], batch))
        logits = logits[batch.num_prompt_rows:]
    sampled = scheduler.sampling_inputs(batch)
    # a PD prefill server's draft KV of the prompt travels to decode with the target's (speculative/round.py)
    drafts_prompt = spec is not None and scheduler.pd_role is PDRole.PREFILL and batch.mode.is_extend
    if not sampled:
        if drafts_prompt:
            spec.draft_prompt(scheduler, batch, sampled, None)
        return LaunchedStep(batch, None)
    mask = scheduler.grammar.token_mask([r.grammar for r in sampled], runner.device)
    out = runner.sample(logits, sampled, to_host=not keep_on_device, token_mask=mask)
    ids = out.next_token_ids_device
    if drafts_prompt:
        spec.draft_prompt(scheduler, batch, sampled, ids)
    if tokens is not None:
        rows = torch.tensor([r.row for r in sampled], dtype=torch.int64).to(ids.device, non_blocking=True)
        tokens.index_copy_(0, rows, ids.view(len(sampled), -1))
    for r in sampled:
        r.add_future()
    step = LaunchedStep(batch, out)
    if keep_on_device:
        if ids.device.type == "cuda":
            step.host = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for k, t in out.device.items()}
            for k, t in out.device.items():
                step.host[k].copy_(t, non_blocking=True)
            step.copied = torch.cuda.Event()
            step.copied.record()
        else:
            step.host = out.device
    return step


def _with_known_inputs(fb: ForwardBatch, batch: ScheduledBatch, tokens: torch.Tensor,
                       device: torch.device) -> ForwardBatch:
    """The batch on the device, its FUTURE_TOKEN input ids (only decodes have any: the last num_decodes
    requests, DECODE_LEN tokens each) replaced by the table's tokens of their rows."""
    future = fb.input_ids < 0
    if not bool(future.any()):  # (a host tensor: no sync)
        return fb
    start = fb.num_tokens - batch.num_decodes * DECODE_LEN
    assert not bool(future[:start].any()), "an extend's input is never in flight"
    rows = torch.tensor([r.row for r in batch.reqs[len(batch.reqs) - batch.num_decodes:]], dtype=torch.int64)
    dev = fb.to(device)
    ids = dev.input_ids[start:]
    known = torch.where(ids >= 0, ids, tokens[rows.to(device, non_blocking=True)].view(-1))
    dev.input_ids = torch.cat([dev.input_ids[:start], known]) if start else known
    return dev


def resolve_step(scheduler: Scheduler, step: LaunchedStep, sync: RankSync | None = None) -> list[TokenOut]:
    """Wait for the step's tokens on the host and hand them to the scheduler: the step's outputs."""
    if step.round is not None:
        r = step.round
        return scheduler.process_result(step.batch, r.tokens, r.logprobs, r.top_logprobs)
    if step.out is None:
        return scheduler.process_result(step.batch, [], None, None)
    out = step.out
    if step.in_flight:
        if step.copied is not None:
            step.copied.synchronize()
        out.read(step.host)
    if sync is not None:
        out = sync.share_sample(out)
    lps = tops = None  # the sampler's one token per request, as lists
    if out.logprobs is not None:
        lps, tops = [[x] for x in out.logprobs], [[x] for x in out.top_logprobs]
    return scheduler.process_result(step.batch, [[t] for t in out.next_token_ids], lps, tops)


def can_stay_in_flight(batch: ScheduledBatch, sampled: list[Req]) -> bool:
    """A decode step whose tokens nobody reads on the host before the next step launches."""
    return batch.mode.is_decode and not _reads_outputs(sampled)


def run_step(scheduler: Scheduler, runner: ModelRunner, sync: RankSync | None = None,
             stop: bool = False) -> list[TokenOut] | None:
    """One scheduler step on one rank, back to back: schedule, (header), rebalance, forward, sample, process.
    Returns the TokenOuts, or None when some rank is shutting down (multi-rank: every rank learns it from the
    same header)."""
    eplb = runner.rebalancer
    if sync is not None and sync.multi:
        batch = None if stop else scheduler.schedule()
        header = group_header(sync, batch, stop, eplb.status() if eplb is not None else 0, runner)
        if header.any_stop:
            return None
        if eplb is not None:  # between passes, on every rank at once: maybe a chunk of a rebalance
            eplb.begin_pass(header.eplb, forward=any(header.global_num_tokens))
        if header.any_verify and not (batch is not None and batch.is_verify):
            runner.speculative.join_drafts()  # another group drafts: its draft forwards' collectives, with none
        if batch is None:
            join_idle(runner, header)
            return []
    else:
        if stop:
            return None
        batch = scheduler.schedule()
        if eplb is not None:
            eplb.begin_pass([eplb.status()], forward=batch is not None)
        if batch is None:
            return []
    return resolve_step(scheduler, launch_step(scheduler, runner, batch), sync)


def group_header(sync: RankSync, batch: ScheduledBatch | None, stop: bool, eplb: int = 0,
                 runner: ModelRunner | None = None) -> StepHeader:
    """Several ranks: this step's header, exchanged by all; the batch (if any) learns every group's tokens (and
    the padded size of a static-shape step, rank/static_shape.py and rank/static_extend.py)."""
    fb = batch.forward if batch is not None else None
    header = sync.exchange_header(fb.num_tokens if fb is not None else 0,
                                  bool(batch is not None and batch.mode.is_extend), stop, eplb,
                                  runner is not None and runner.static_ready(fb),
                                  bool(batch is not None and batch.is_verify),
                                  runner is not None and runner.static_extend_ready(fb))
    if fb is not None:
        _take_header(fb, header, runner)
    return header


def _take_header(fb: ForwardBatch, header: StepHeader, runner: ModelRunner | None) -> None:
    """What the step's batch learns from the header: every group's tokens and the agreed padded sizes."""
    fb.global_num_tokens, fb.any_extend = header.global_num_tokens, header.any_extend
    static, extend = (runner.static_decode, runner.static_extend) if runner is not None else (None, None)
    fb.static_bs = header.padded_decode_size(static.bs_buckets) if static is not None else None
    fb.static_num_tokens = header.padded_extend_size(extend.buckets) if extend is not None else None


def join_idle(runner: ModelRunner, header: StepHeader) -> None:
    """A rank with nothing to run joins the MoE collectives with an IDLE batch, when some other group runs (in a
    static-shape step, with the agreed number of padding rows)."""
    if any(header.global_num_tokens):
        fb = ForwardBatch.idle()
        _take_header(fb, header, runner)
        runner.forward(fb)


def overlap_refusal(scheduler: Scheduler, runner: ModelRunner, sync: RankSync | None) -> str | None:
    """Why this rank cannot overlap its steps, or None."""
    if sync is not None and sync.multi and sync.group_size > 1:
        return "the ranks of an attention TP group run each step on the leader's tokens, shared on the host"
    if runner.expert_recorder is not None or runner.rebalancer is not None:
        return "the expert distribution recorder (and the rebalancer) act between passes"
    if runner.speculative is not None:
        return "speculative decoding's steps are run back to back"
    return None


class StepPipeline:
    """Steps with at most one decode step in flight (module docstring), or back to back (run_step)."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, sync: RankSync | None = None,
                 overlap: bool = True):
        self.scheduler, self.runner, self.sync = scheduler, runner, sync
        if runner.speculative is not None and sync is not None:
            runner.speculative.sync = sync
        why = overlap_refusal(scheduler, runner, sync) if overlap else None
        if why is not None:
            logger.info("overlap scheduling is off: %s", why)
        self.overlap = overlap and why is None
        self.in_flight: LaunchedStep | None = None
        self.num_overlapped = 0  # steps launched while the one before was still in flight
        rows = len(scheduler.req_table.table)
        self.tokens = torch.zeros(rows, DECODE_LEN, dtype=torch.int64, device=runner.device) if self.overlap else None

    @property
    def busy(self) -> bool:
        """A step is in flight: its outputs come with the next call."""
        return self.in_flight is not None

    def step(self, stop: bool = False) -> list[TokenOut] | None:
        """One step; its outputs, the in-flight step's, or both. None when the rank stops."""
        if not self.overlap:
            return run_step(self.scheduler, self.runner, self.sync, stop)
        multi = self.sync is not None and self.sync.multi
        if stop and not multi:  # the rank stops: the step in flight, if any, is not resolved (nobody reads it)
            return None
        prev, self.in_flight = self.in_flight, None
        outs: list[TokenOut] = []
        if prev is not None and not self.scheduler.can_schedule_ahead():
            outs, prev = resolve_step(self.scheduler, prev), None
        batch = None if stop else self.scheduler.schedule()
        if multi:  # the header goes round while the device may still run the step before
            header = group_header(self.sync, batch, stop, runner=self.runner)
            if header.any_stop:
                return None
            if batch is None:
                join_idle(self.runner, header)
        if batch is None:
            return outs + (resolve_step(self.scheduler, prev) if prev is not None else [])
        sampled = self.scheduler.sampling_inputs(batch)
        if prev is not None and _reads_outputs(sampled):
            outs, prev = resolve_step(self.scheduler, prev), None  # the sampling reads known tokens only
        stay = can_stay_in_flight(batch, sampled)
        cur = launch_step(self.scheduler, self.runner, batch, self.tokens, keep_on_device=stay)
        if prev is not None:  # while the device runs `cur`
            self.num_overlapped += 1
            outs += resolve_step(self.scheduler, prev)
        if stay:
            self.in_flight = cur
        else:
            outs += resolve_step(self.scheduler, cur)
        return outs

    def flush(self) -> list[TokenOut]:
        """Resolve the step in flight, if any."""
        prev, self.in_flight = self.in_flight, None
        return resolve_step(self.scheduler, prev) if prev is not None else []


def _reads_outputs(sampled: list[Req]) -> bool:
    return any(r.params.uses_penalties or r.grammar is not None for r in sampled)
