"""One speculative round on one rank: draft k tokens per request by chaining the draft model, verify [t, d_1..d_k]
in one target forward (k + 1 tokens per request over the paged KV), accept (acceptance.py), and give
back the KV of the rejected drafts.

Positions. A request whose target KV holds positions [0, L) and whose last token t = x_L has no KV yet:
  - the draft model's row at position p reads (x_{p+1}, h_p), h_p the target's hidden state that predicted x_{p+1};
    its KV is valid for positions [0, draft_start), and Req.draft_hidden holds h_p for [draft_start, L);
  - drafting: one extend over [draft_start, L) (the last row gives d_1 and g_1; run as decode rows when it covers
    at most k + 1 positions, the last round's accepted tokens: verify_rows.py), then k - 1 one-token steps at
    positions L .. L + k - 2 reading (d_{j-1}, g_{j-1}), which write the draft's KV in the verify step's slots
    (scratch: the next round's extend writes those positions again with the target's hidden states);
  - verify: the target over [x_L, d_1..d_k] at positions L .. L + k gives k + 1 rows of logits and h_L .. h_{L+k}
    (run as k + 1 decode rows per request, each over its causal prefix: verify_rows.py);
  - after accepting a drafts: the target's KV keeps [0, L + a + 1), the slots of the rejected positions are freed
    (never cached), draft_start = L and draft_hidden = h_L .. h_{L+a}.
A prefill's (or chunk's) hidden states join draft_hidden the same way (`after_extend`).

PD disaggregation: the prefill server runs the draft over the prompt's rows right after each extend
(`draft_prompt`; the last row reads the token it sampled), so the draft's KV of the prompt travels to decode with
the target's, and its `done` carries h_{L-1}; decode seeds draft_start = L - 1, draft_hidden = h_{L-1}
(rank/pd_host.py) and drafts from there as above.

Drafts are the draft model's argmax (q one-hot), for greedy and sampled requests alike: the sampling rule keeps the
target's distribution for any q (acceptance.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from moeserve.core.forward_batch import ForwardBatch, ForwardMode
from moeserve.rank.rank_sync import RankSync
from moeserve.rank.request import Req
from moeserve.rank.sampler import SamplingBatch
from moeserve.rank.scheduled_batch import ScheduledBatch
from moeserve.rank.speculative.acceptance import accept_greedy, accept_sampled, expand_rows, processed_probs
from moeserve.rank.speculative.draft_graphs import DraftStepGraphs
from moeserve.rank.speculative.drafter import Drafter
from moeserve.rank.speculative.verify_rows import extend_as_decode, verify_as_decode

logger = logging.getLogger(__name__)


@dataclass
class RoundResult:
    """A verify step's tokens, per request in the batch's order (the lists process_result takes)."""

    tokens: list[list[int]]
    logprobs: list[list[float]] | None
    top_logprobs: list[list[list[tuple[int, float]]]] | None
    num_accepted: list[int]


class SpeculativeRound:
    """Drafts and verifies for a rank's scheduler; `runner` is its ModelRunner (forward_hidden, sampling rng)."""

    def __init__(self, runner, drafter: Drafter, num_draft_tokens: int, draft_graphs: DraftStepGraphs | None = None):
        assert num_draft_tokens >= 1
        self.runner, self.drafter, self.k = runner, drafter, num_draft_tokens
        # the draft's one-token steps in CUDA graphs (draft_graphs.py), else eagerly
        self.draft_graphs = draft_graphs
        self.draft_step = draft_graphs.forward if draft_graphs is not None else drafter.forward
        # an attention-TP group of several ranks: every rank keeps the leader's tokens (as the sampler's are
        # shared), so that their schedulers never part; set by the step pipeline
        self.sync: RankSync | None = None

    # ------------------------------------------------------------------ prefill
    def after_extend(self, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        """A prefill (or chunk) ran: its hidden states [T, H] join each request's draft_hidden."""
        fb = batch.forward
        start = 0
        for req, n, prefix in zip(batch.reqs, fb.extend_lens_cpu, fb.prefix_lens_cpu, strict=True):
            rows = hidden[start:start + n]
            start += n
            held = req.draft_hidden
            if held is not None and req.draft_start + len(held) == prefix:
                req.draft_hidden = torch.cat([held, rows])
            else:  # a new request (after its cached prefix), or one recomputed after a retraction
                req.draft_start, req.draft_hidden = prefix, rows

    # ------------------------------------------------------------------ a round
    @torch.inference_mode()
    def run(self, scheduler, batch: ScheduledBatch) -> RoundResult:
        """Draft, verify and accept for every request of the verify step `batch`; the KV of rejected drafts goes
        back to the scheduler's pool."""
        reqs, k = batch.reqs, self.k
        fb = batch.forward
        bs = len(reqs)
        kv_lens = fb.prefix_lens_cpu  # L per request
        drafts = self.draft(scheduler, reqs, kv_lens)  # [B, k] on the device

        # the verify as B * (k + 1) decode rows (verify_rows.py): the absorbed MLA path, not an extend
        dev = verify_as_decode(fb, k + 1).to(self.runner.device)  # logits of every row: a decode step's rows
        ids = dev.input_ids.view(bs, k + 1)
        dev.input_ids = torch.cat([ids[:, :1], drafts], dim=1).reshape(-1)
        logits, hidden = self.runner.forward_hidden(dev)  # [B * (k + 1), V], [B * (k + 1), H]

        sbatch = SamplingBatch.build([r.params for r in reqs], [r.input_ids for r in reqs],
                                     [r.output_ids for r in reqs], self.runner.vocab_size, self.runner.device,
                                     rng=self.runner.rng)
        vocab = logits.shape[-1]
        if sbatch.all_greedy:
            accepted = accept_greedy(drafts, logits.argmax(dim=-1).view(bs, k + 1))
        else:
            p = processed_probs(logits, expand_rows(sbatch, k + 1)).view(bs, k + 1, vocab)
            accepted = accept_sampled(drafts, p, None, sbatch.seeds, sbatch.steps)
        tokens = accepted.to_lists()
        lps = tops = None
        if any(r.asked.return_logprob for r in reqs):
            lps, tops = self._logprobs(logits.view(bs, k + 1, vocab), tokens, reqs)
        if self.sync is not None:
            tokens, lps, tops = self.sync.share_messages((tokens, lps, tops))
        num_accepted = [len(t) - 1 for t in tokens]

        hidden = hidden.view(bs, k + 1, -1)
        for b, (req, a) in enumerate(zip(reqs, num_accepted, strict=True)):
            scheduler.trim_kv(req, kv_lens[b] + a + 1)  # the rejected drafts' KV: freed, never cached
            req.draft_start, req.draft_hidden = kv_lens[b], hidden[b, :a + 1]
            req.spec_verify_ct += 1
        return RoundResult(tokens, lps, tops, num_accepted)

    @torch.inference_mode()
    def join_drafts(self) -> None:
        """Several DP groups: another group drafts this step and this one does not (it prefills or idles): the
        draft model's k forwards with no tokens, so that its MoE collectives meet theirs, before the target's."""
        fb = ForwardBatch.idle().to(self.runner.device)
        hidden = torch.zeros(0, self.runner.config.hidden_size, dtype=self.runner.dtype, device=self.runner.device)
        for _ in range(self.k):
            self.drafter.forward(fb, fb.input_ids, hidden)

    def draft(self, scheduler, reqs: list[Req], kv_lens: list[int]) -> torch.Tensor:
        """d_1..d_k per request, [B, k] int64 on the device (module docstring: positions)."""
        table = scheduler.req_table
        device = self.runner.device
        rows = [req.row for req in reqs]
        for req, kv_len in zip(reqs, kv_lens, strict=True):
            assert req.draft_hidden is not None and req.draft_start + len(req.draft_hidden) == kv_len, (
                req.rid, req.draft_start, None if req.draft_hidden is None else len(req.draft_hidden), kv_len)
        pairs = list(zip(reqs, kv_lens, strict=True))
        ids = [t for req, kv_len in pairs for t in req.fill_ids[req.draft_start + 1:kv_len + 1]]
        extend_lens = [kv_len - req.draft_start for req, kv_len in pairs]
        last = torch.as_tensor(np.cumsum(extend_lens) - 1, device=device)
        if max(extend_lens) <= self.k + 1:  # the last round's accepted tokens: decode rows, graphed where they fit
            logits, g = self._draft_extend(scheduler, reqs, kv_lens, ids, as_rows=True)
            logits = logits[last]
        else:  # a prompt (or a chunk) not drafted over yet
            logits, g = self._draft_extend(scheduler, reqs, kv_lens, ids)
        token, g = logits.argmax(dim=-1), g[last]
        drafts = [token]
        block = table.table[rows, : max(kv_lens) + self.k]  # every draft step's slots, padded
        for j in range(1, self.k):  # position L + j - 1 reads (d_j, g_j); one token each: the decode path
            lens = [kv_len + j for kv_len in kv_lens]
            fb = ForwardBatch.build(ForwardMode.DECODE, [0] * len(reqs), lens, [1] * len(reqs),
                                    np.array([table.table[r.row, n - 1] for r, n in zip(reqs, lens, strict=True)]),
                                    table.gather(rows, lens))
            fb.decode_slots = torch.from_numpy(block[:, : max(lens)])
            logits, g = self.draft_step(fb.to(device), token, g)
            token = logits.argmax(dim=-1)
            drafts.append(token)
        return torch.stack(drafts, dim=1)

    def _draft_extend(self, scheduler, reqs: list[Req], ends: list[int], ids: list[int],
                      last_ids: torch.Tensor | None = None, last_of: list[bool] | None = None,
                      as_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft extend over positions [req.draft_start, end) of each request, reading ids (the token after
        each position, host ints) and the first end - draft_start rows of req.draft_hidden; writes the draft's KV.
        last_ids [sum(last_of)] on the device: the ids of the last rows of the requests flagged in last_of, in
        order (tokens sampled this step, not on the host yet). Returns the drafter's (logits of each request's
        last row, hidden [T, H]); as_rows: the extend runs as one decode row per token (verify_rows.py) through
        draft_step (graphs where they fit), and the logits are every row's [T, V]."""
        table = scheduler.req_table
        device = self.runner.device
        rows = [req.row for req in reqs]
        extend_lens = [end - req.draft_start for req, end in zip(reqs, ends, strict=True)]
        locs = [table.table[req.row, req.draft_start:end] for req, end in zip(reqs, ends, strict=True)]
        fb = ForwardBatch.build(ForwardMode.EXTEND, ids, ends, extend_lens, np.concatenate(locs),
                                table.gather(rows, ends))
        fb = (extend_as_decode(fb) if as_rows else fb).to(device)
        input_ids = fb.input_ids
        if last_ids is not None:
            at = np.cumsum(extend_lens)[np.asarray(last_of, dtype=bool)] - 1
            input_ids = input_ids.index_put((torch.as_tensor(at, device=device),), last_ids.view(-1))
        hidden = torch.cat([req.draft_hidden[:n].to(device) for req, n in zip(reqs, extend_lens, strict=True)])
        return (self.draft_step if as_rows else self.drafter.forward)(fb, input_ids, hidden)

    # ------------------------------------------------------------------ PD prefill
    @torch.inference_mode()
    def draft_prompt(self, scheduler, batch: ScheduledBatch, sampled: list[Req],
                     next_ids: torch.Tensor | None) -> None:
        """The prefill server of a PD pair, after an extend (a chunk, or a prompt's end): the draft model's KV of
        the positions it computed, now, so that it travels to decode with the target's (disagg/prefill.py sends
        a chunk's complete pages after its step; the draft's KV pool is one more buffer beside the target's, at
        the same slots). Row p reads x_{p+1}: a prompt token, or for the last prompt row the token sampled this
        step (next_ids [len(sampled)] on the device, in `sampled`'s order).

        Afterwards a request that sampled holds h_{L-1} alone, at draft_start L - 1: what decode's first draft
        extend reads (it recomputes that row, writing the same KV) and what prefill's `done` carries
        (rank/pd_host.py). A chunk holds nothing (draft_start at its end): the next chunk's rows join it."""
        fb = batch.forward
        index = {id(r): i for i, r in enumerate(sampled)}
        reqs, ends, ids, last_of, order = [], [], [], [], []
        for req, n, prefix, done in zip(batch.reqs, fb.extend_lens_cpu, fb.prefix_lens_cpu, batch.finishes_prefill,
                                        strict=True):
            end = prefix + n
            fresh = done and id(req) in index  # its last row reads the token sampled now
            stop = end if fresh or not done else end - 1  # (a prompt that samples nothing: its last row waits)
            start = req.draft_start
            assert req.draft_hidden is not None and start + len(req.draft_hidden) == end, (req.rid, start, end)
            if stop > start:
                reqs.append(req)
                ends.append(stop)
                known = req.fill_ids[start + 1:stop + 1]
                ids.extend(known + [0] * (stop - start - len(known)))  # the sampled token: filled on the device
                last_of.append(fresh)
                if fresh:
                    order.append(index[id(req)])
        if reqs:
            last_ids = None
            if order:
                last_ids = next_ids.view(len(sampled), -1)[:, 0][torch.as_tensor(order, device=next_ids.device)]
            self._draft_extend(scheduler, reqs, ends, ids, last_ids, last_of)
        for req, n, prefix, done in zip(batch.reqs, fb.extend_lens_cpu, fb.prefix_lens_cpu, batch.finishes_prefill,
                                        strict=True):
            keep = prefix + n - 1 if done else prefix + n
            req.draft_hidden = req.draft_hidden[keep - req.draft_start:]
            req.draft_start = keep

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: list[list[int]], reqs: list[Req]
                  ) -> tuple[list[list[float]], list[list[list[tuple[int, float]]]]]:
        """The raw log-probabilities of each emitted token (logits [B, k + 1, V]), and the top alternatives each
        request asked for, as the sampler reports them for one token."""
        raw = torch.log_softmax(logits.float(), dim=-1)
        lps, tops = [], []
        top_n = max((r.asked.top_logprobs_num for r in reqs if r.asked.return_logprob), default=0)
        values = ids = None
        if top_n:
            values, ids = raw.topk(min(top_n, raw.shape[-1]), dim=-1)
            values, ids = values.tolist(), ids.tolist()
        for b, (req, toks) in enumerate(zip(reqs, tokens, strict=True)):
            n = len(toks)
            index = torch.tensor(toks, device=raw.device)
            lps.append(raw[b, torch.arange(n, device=raw.device), index].tolist())
            m = req.asked.top_logprobs_num if req.asked.return_logprob else 0
            tops.append([list(zip(ids[b][j][:m], values[b][j][:m], strict=True)) if m else [] for j in range(n)])
        return lps, tops
