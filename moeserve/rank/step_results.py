"""What a scheduler does with a step's results: the sampled tokens in place of their future tokens, the prompt
logprobs, finish checks (stop tokens, length, context, stop strings), finished requests out and their KV back.

Mixed into Scheduler (scheduler.py), whose state it uses: the request table `reqs`, `running`, `pending_out`,
`stats`, `pd`, `args`, `tokenizer`, `context_length` and `_release`.
"""

from __future__ import annotations

import logging

from moeserve.args import PDRole
from moeserve.rank.io_struct import FinishReason, TokenOut
from moeserve.rank.request import Req
from moeserve.rank.sampler import NO_TOKEN
from moeserve.rank.scheduled_batch import ScheduledBatch

logger = logging.getLogger(__name__)


class StepResults:
    """Mixed into Scheduler: a step's results in, outputs out."""

    def sampling_inputs(self, batch: ScheduledBatch) -> list[Req]:
        """The requests of the batch that sample a token this step (full prefill or decode)."""
        return [r for r, f in zip(batch.reqs, batch.finishes_prefill, strict=True) if f and r.samples]

    def add_prompt_logprobs(self, batch: ScheduledBatch, logprobs: list[float],
                            top_logprobs: list[list[tuple[int, float]]]) -> None:
        """Store the scores of the batch's prompt rows (the first batch.num_prompt_rows rows of its logits)."""
        assert len(logprobs) == len(top_logprobs) == batch.num_prompt_rows
        start = 0
        for req, n in zip(batch.prompt_reqs, batch.prompt_counts, strict=True):
            req.input_logprobs.extend(logprobs[start:start + n])
            req.input_top_logprobs.extend(top_logprobs[start:start + n])
            start += n

    def process_result(self, batch: ScheduledBatch, next_ids: list[list[int]], logprobs: list[list[float]] | None,
                       top_logprobs: list[list[list[tuple[int, float]]]] | None) -> list[TokenOut]:
        """Put the sampled tokens (a list per sampling request, in order; logprobs likewise) in place of their future
        tokens, finish requests, return outputs. A request that ended since the step was launched (it finished in
        the step before, or was aborted) is passed over: its tokens of this step are dropped."""
        sampled = self.sampling_inputs(batch)
        assert len(sampled) == len(next_ids)
        outs = self.pending_out
        self.pending_out = []
        if batch.mode.is_extend:
            for req, done in zip(batch.reqs, batch.finishes_prefill, strict=True):
                if not self._live(req):
                    continue
                if done and not req.samples:  # a prompt scored with max_new_tokens = 0: done, no token
                    req.finish_reason = FinishReason("length")
                    self._release(req, cache=True)
                    del self.reqs[req.rid]
                    outs.append(req.take_output())
                    self.stats.finished += 1
                elif done and req not in self.running:
                    self.running.append(req)
        for i, req in enumerate(sampled):
            if not self._live(req):
                continue
            tokens = next_ids[i]
            later = req.resolve_future(tokens)
            failed = self._no_token(req, tokens) if NO_TOKEN in tokens else self._refused(req, tokens)
            if failed is not None:  # the step's tokens are dropped
                del req.output_ids[len(req.output_ids) - len(tokens):]
                self._fail(req, *failed)
                outs.append(req.take_output())
                continue
            kept = self._check_finish(req, len(tokens))
            if req.finished and batch.is_verify:  # the KV of tokens past a stop inside the run: never cached
                self.trim_kv(req, len(req.fill_ids))
            if req.asked.return_logprob and logprobs is not None:
                req.logprobs.extend(logprobs[i][:kept])
                req.top_logprobs.extend(top_logprobs[i][:kept] if top_logprobs else [[]] * kept)
            self.stats.generated += kept
            if req.finished and self.pd is not None and self.pd.holds(req):  # prefill: decode gets it first
                self.pd.after_extend(req, req.kv_len, self.pd_first(req))
            elif req.finished:
                self.running.remove(req)
                self._release(req, cache=True)
                del self.reqs[req.rid]
                outs.append(req.take_output())
                self.stats.finished += 1
            elif req.asked.stream and len(req.output_ids) - req.num_sent >= self.args.stream_interval:
                outs.append(req.take_output())
            if not req.finished:
                req.restore_future(later)
        if batch.mode.is_extend:
            self.stats.prefilled += batch.num_prefill_tokens
            self.stats.mixed_steps += batch.mode.is_mixed
            if self.pd is not None and self.pd_role is PDRole.PREFILL:
                for req, done in zip(batch.reqs, batch.finishes_prefill, strict=True):
                    if not done:  # a chunk: its complete pages can go
                        self.pd.after_extend(req, req.kv_len, None)
        return outs

    def _live(self, req: Req) -> bool:
        """Still this scheduler's (not finished, aborted or failed since its step was launched)."""
        return not req.finished and self.reqs.get(req.rid) is req

    @staticmethod
    def _no_token(req: Req, tokens: list[int]) -> tuple[str, int]:
        """Why a step sampled no token (the sampler's NO_TOKEN): the error and its status code."""
        at = len(req.output_ids) - len(tokens) + tokens.index(NO_TOKEN)
        if req.grammar is not None:  # its mask left nothing (non-finite logits would too: not told apart)
            return (f"the request's grammar allows no token at output token {at} (a grammar that can never end?)",
                    400)
        logger.error("request %s: the model's logits are not finite (NaN or inf) at output token %d; failing it",
                     req.rid, at)
        return f"the model computed non-finite logits (NaN or inf) at output token {at}; no token could be sampled", 500

    @staticmethod
    def _refused(req: Req, tokens: list[int]) -> tuple[str, int] | None:
        """The error if the request's grammar refuses one of the step's tokens (the mask forbade it), else None."""
        if req.grammar is None or all(req.grammar.accept_token(t) for t in tokens):
            return None
        logger.error("request %s: its grammar refused a token of %s", req.rid, tokens)
        return f"a sampled token of {tokens} does not match the request's grammar", 500

    def _fail(self, req: Req, message: str, status_code: int = 500) -> None:
        """End a request whose step gave no token it can keep (non-finite logits, a grammar that allows none or
        refuses the one sampled): an error, not a token; its KV is not cached."""
        req.finish_reason = FinishReason("abort", status_code=status_code, message=message)
        if self.pd is not None and self.pd.holds(req):  # prefill: decode hears `failed`, KV freed after writes
            del self.reqs[req.rid]
            self.pd.abort(req)
            return
        self.running.remove(req)
        self._release(req, cache=False)
        del self.reqs[req.rid]

    def drain_pending(self) -> list[TokenOut]:
        outs, self.pending_out = self.pending_out, []
        return outs

    def _check_finish(self, req: Req, num_new: int) -> int:
        """Finish checks (stop token, length, context, stop string) over the request's last num_new output tokens,
        in order: the first that finishes it ends its output there. Returns how many of them stay."""
        first, p = len(req.output_ids) - num_new, req.params
        for end in range(first + 1, first + num_new + 1):
            token = req.output_ids[end - 1]
            if token in req.stop_token_ids:
                req.finish_reason = FinishReason("stop", matched=token)
            elif end == first + num_new and req.grammar is not None and req.grammar.is_terminated():
                req.finish_reason = FinishReason("stop", matched=token)  # it took a stop token (with ignore_eos)
            elif end >= p.max_new_tokens:
                req.finish_reason = FinishReason("length")
            elif len(req.input_ids) + end >= self.context_length:
                req.finish_reason = FinishReason("length", message="reached the context length")
            elif p.stop and self.tokenizer is not None:
                stops = [p.stop] if isinstance(p.stop, str) else p.stop
                longest = max(len(s) for s in stops)
                tail = self.tokenizer.decode(req.output_ids[max(end - longest - 8, 0):end], skip_special_tokens=False)
                req.finish_reason = next((FinishReason("stop", matched=s) for s in stops if s and s in tail), None)
            if req.finished:
                del req.output_ids[end:]
                return end - first
        return num_new
