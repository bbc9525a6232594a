"""One speculative round on one rank: draft k tokens per request by chaining the draft model, verify [t, d_1..d_k]
in one target forward (k + 1 tokens per request over the paged KV), accept (acceptance.py), and give
back the KV of the rejected drafts.

Positions. A request whose target KV holds positions [0, L) and whose last token t = x_L has no KV yet:
  - the draft model's row at position p reads (x_{p+1}, h_p), h_p the target's hidden state that predicted x_{p+1};
    its KV is valid for positions [0, draft_start), and Req.draft_hidden holds h_p for [draft_start, L);
  - drafting: one extend over [draft_start, L) (the last row gives d_1 and g_1), then k - 1 one-token steps at
    positions L .. L + k - 2 reading (d_{j-1}, g_{j-1}), which write the draft's KV in the verify step's slots
    (scratch: the next round's extend writes those positions again with the target's hidden states);
  - verify: the target over [x_L, d_1..d_k] at positions L .. L + k gives k + 1 rows of logits and h_L .. h_{L+k}
    (run as k + 1 decode rows per request, each over its causal prefix: verify_rows.py);
  - after accepting a drafts: the target's KV keeps [0, L + a + 1), the slots of the rejected positions are freed
    (never cached), draft_start = L and draft_hidden = h_L .. h_{L+a}.
A prefill's (or chunk's) hidden states join draft_hidden the same way (`after_extend`).

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
from moeserve.rank.speculative.drafter import Drafter
from moeserve.rank.speculative.verify_rows import verify_as_decode

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

    def __init__(self, runner, drafter: Drafter, num_draft_tokens: int):
        assert num_draft_tokens >= 1
        self.runner, self.drafter, self.k = runner, drafter, num_draft_tokens
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
        dev = verify_as_decode(fb, k + 1).to(self.runner.device)
        ids = dev.input_ids.view(bs, k + 1)
        dev.input_ids = torch.cat([ids[:, :1], drafts], dim=1).reshape(-1)
        dev.logits_indices = None
        dev.return_all_logits = True
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
        ids, seq_lens, extend_lens, locs, rows = [], [], [], [], []
        for req, kv_len in zip(reqs, kv_lens, strict=True):
            start = req.draft_start
            assert req.draft_hidden is not None and start + len(req.draft_hidden) == kv_len, (
                req.rid, start, None if req.draft_hidden is None else len(req.draft_hidden), kv_len)
            ids.extend(req.fill_ids[start + 1:kv_len + 1])
            seq_lens.append(kv_len)
            extend_lens.append(kv_len - start)
            locs.append(table.table[req.row, start:kv_len])
            rows.append(req.row)
        fb = ForwardBatch.build(ForwardMode.EXTEND, ids, seq_lens, extend_lens, np.concatenate(locs),
                                table.gather(rows, seq_lens)).to(device)
        hidden = torch.cat([r.draft_hidden for r in reqs])
        logits, g = self.drafter.forward(fb, fb.input_ids, hidden)
        last = torch.as_tensor(np.cumsum(extend_lens) - 1, device=device)
        token, g = logits.argmax(dim=-1), g[last]
        drafts = [token]
        for j in range(1, self.k):  # position L + j - 1 reads (d_j, g_j); one token each: the decode path
            lens = [kv_len + j for kv_len in kv_lens]
            fb = ForwardBatch.build(ForwardMode.DECODE, [0] * len(reqs), lens, [1] * len(reqs),
                                    np.array([table.table[r.row, n - 1] for r, n in zip(reqs, lens, strict=True)]),
                                    table.gather(rows, lens)).to(device)
            logits, g = self.drafter.forward(fb, token, g)
            token = logits.argmax(dim=-1)
            drafts.append(token)
        return torch.stack(drafts, dim=1)

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
