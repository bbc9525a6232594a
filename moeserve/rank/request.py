"""Req: one request's state inside a scheduler (tokens, KV bookkeeping, finish state, unsent output)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moeserve.rank.io_struct import FinishReason, GenerateReq, TokenOut
from moeserve.rank.prompt_logprobs import first_scored_position
from moeserve.rank.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from moeserve.constrained.base import GrammarMatcher

NO_POSITION = 1 << 62  # next_scored_position when no prompt position is left to score
FUTURE_TOKEN = -1  # an output token sampled on the device whose value the host does not know yet (steps.py)


@dataclass
class Req:
    """A request inside a scheduler: what was asked (its GenerateReq, never changed here) and what became of it."""

    asked: GenerateReq
    stop_token_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    # KV bookkeeping
    row: int | None = None  # request-to-token table row while the request holds KV
    kv_len: int = 0  # tokens of fill_ids whose KV is in the cache
    prefix_len: int = 0  # leading tokens whose slots belong to the prefix cache (locked through last_node)
    last_node: object = None  # the prefix cache's handle of that match (PrefixMatch.node)
    cached_tokens: int = 0  # reported: prompt tokens served from the prefix cache
    cached_tokens_details: dict[str, int] | None = None  # reported with a hierarchical cache: tokens per tier
    # finish and streaming
    finish_reason: FinishReason | None = None
    num_sent: int = 0  # output tokens already sent to the client
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    num_retractions: int = 0
    num_future: int = 0  # trailing output_ids that are FUTURE_TOKEN: sampled in a step still in flight
    # prompt logprobs (prompt_logprobs.py): the next prompt position to score (past the end: none left)
    next_scored_position: int = NO_POSITION
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]]] | None = field(default_factory=list)
    input_logprobs_sent: bool = False
    # structured outputs: where the output stands in its grammar (it has accepted every known output token)
    grammar: GrammarMatcher | None = None
    # speculative decoding (rank/speculative/round.py): the target's hidden states [P, H] (on the device) of the
    # positions [draft_start, draft_start + P) the draft model has not read yet, and the verify steps run
    draft_hidden: torch.Tensor | None = None
    draft_start: int = 0
    spec_verify_ct: int | None = None  # (0 once the scheduler decodes it speculatively)

    @classmethod
    def from_generate(cls, r: GenerateReq, eos_token_ids: list[int]) -> Req:
        stop_ids = set(r.sampling_params.stop_token_ids or [])
        if not r.sampling_params.ignore_eos:
            stop_ids.update(eos_token_ids)
        req = cls(asked=r, stop_token_ids=frozenset(stop_ids))
        if r.return_logprob and r.logprob_start_len >= 0:
            req.next_scored_position = first_scored_position(r.logprob_start_len)
            if r.logprob_start_len == 0:  # nothing predicts the first token
                req.input_logprobs.append(None)
                req.input_top_logprobs.append([])
        return req

    def prompt_scored_elsewhere(self) -> None:
        """PD decode: it never runs the prompt; prefill scores it and the router prepends prefill's
        input_token_logprobs to this side's, so this side reports an empty list, and no input_top_logprobs (the
        router does not merge those: an empty list would claim the prompt has no alternatives)."""
        self.next_scored_position = NO_POSITION
        self.input_logprobs, self.input_top_logprobs = [], None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt positions are left to score."""
        return self.next_scored_position < len(self.input_ids) - 1

    @property
    def samples(self) -> bool:
        """It samples a token when its prefill ends (a prompt scored with max_new_tokens = 0 does not)."""
        return self.params.max_new_tokens > 0

    @property
    def rid(self) -> str:
        return self.asked.rid

    @property
    def input_ids(self) -> list[int]:
        return self.asked.input_ids

    @property
    def params(self) -> SamplingParams:
        return self.asked.sampling_params

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose KV the request needs: prompt, then output (the last output's KV comes next step)."""
        return self.input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add_future(self) -> None:
        """A step samples this request's next tokens on the device: one placeholder in the output for all of them
        (a verify step learns how many it accepted only when it resolves)."""
        self.output_ids.append(FUTURE_TOKEN)
        self.num_future += 1

    def resolve_future(self, tokens: list[int]) -> list[int]:
        """The oldest placeholder is `tokens` (one step's); the later ones (steps launched since) are cut off and
        returned, so that the output ends at the tokens just learned: finish checks and streaming see only known
        tokens. Put them back with restore_future unless the request finished."""
        first = len(self.output_ids) - self.num_future
        later = self.output_ids[first + 1:]
        self.output_ids[first:] = tokens
        self.num_future = 0
        return later

    def restore_future(self, later: list[int]) -> None:
        self.output_ids.extend(later)
        self.num_future = len(later)

    def drop_future(self) -> None:
        """Forget the tokens still in flight (the request ends before they arrive)."""
        if self.num_future:
            del self.output_ids[-self.num_future:]
            self.num_future = 0

    def take_output(self) -> TokenOut:
        """The tokens (and logprobs) not yet sent, marking them sent."""
        start = self.num_sent
        self.num_sent = len(self.output_ids)
        inputs = None
        if self.asked.return_logprob and self.asked.logprob_start_len >= 0 and not self.input_logprobs_sent:
            if not self.wants_prompt_logprobs and (self.output_ids or self.finish_reason is not None):
                inputs = (self.input_logprobs, self.input_top_logprobs if self.asked.top_logprobs_num else None)
                self.input_logprobs_sent = True
        return TokenOut(
            rid=self.rid,
            new_token_ids=self.output_ids[start:],
            finish_reason=self.finish_reason,
            prompt_tokens=len(self.input_ids),
            completion_tokens=len(self.output_ids),
            cached_tokens=self.cached_tokens,
            cached_tokens_details=self.cached_tokens_details,
            logprobs=self.logprobs[start:] if self.asked.return_logprob else None,
            top_logprobs=(self.top_logprobs[start:] if self.asked.return_logprob and self.asked.top_logprobs_num
                          else None),
            input_logprobs=inputs[0] if inputs else None,
            input_top_logprobs=inputs[1] if inputs else None,
            spec_verify_ct=self.spec_verify_ct,
        )
