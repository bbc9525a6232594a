"""What a scheduler step hands the model runner (ScheduledBatch) and the counters of its periodic log line."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from moeserve.core.forward_batch import ForwardBatch, ForwardMode
from moeserve.rank.request import Req


@dataclass
class ScheduledBatch:
    """What one step runs: the requests and, for EXTEND and MIXED, how many tokens of each (a chunk may be partial;
    a MIXED step's decodes come last, DECODE_LEN tokens each)."""

    mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int]
    forward: ForwardBatch
    finishes_prefill: list[bool]  # per request: this step reaches the end of its fill_ids (so it samples)
    # prompt logprobs: the first len(prompt_targets) rows of the logits score these prompt tokens, requests in
    # order, prompt_counts[i] rows for prompt_reqs[i] (prompt_logprobs.py)
    prompt_reqs: list[Req] = field(default_factory=list)
    prompt_counts: list[int] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)
    # a verify step (speculative decoding, rank/speculative/): an EXTEND of [t, d_1..d_k] per running request
    num_draft_tokens: int = 0

    @property
    def num_prompt_rows(self) -> int:
        return len(self.prompt_targets)

    @property
    def num_decodes(self) -> int:
        """Requests that decode DECODE_LEN tokens this step: all of a DECODE step, the last ones of a MIXED step."""
        return len(self.reqs) if self.mode.is_decode else self.forward.num_decodes

    @property
    def is_verify(self) -> bool:
        return self.num_draft_tokens > 0

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt (or recomputed) tokens of this step; a MIXED step's decode tokens are not among them."""
        if self.mode.is_decode or self.is_verify:
            return 0
        return sum(self.extend_lens[:len(self.extend_lens) - self.forward.num_decodes])


class SchedulerStats:
    """Counters for the periodic log line."""

    def __init__(self) -> None:
        self.generated = 0
        self.prefilled = 0
        self.finished = 0
        self.retractions = 0
        self.mixed_steps = 0  # steps that ran a prefill and decodes together (--enable-mixed-chunk)
        self.last_log = time.monotonic()
        self.launched: ForwardMode | None = None  # the mode of the step launch_step last launched
        # speculative decoding: verify steps' drafts, accepted drafts, and rounds (request-rounds)
        self.spec_drafted = 0
        self.spec_accepted = 0
        self.spec_rounds = 0
        self.step_counts: dict[str, int] = {}  # per mode since the last log line: steps, and their wall seconds
        self.step_seconds: dict[str, float] = {}

    def add_round(self, num_accepted: list[int], num_draft_tokens: int) -> None:
        """A verify step's accepted drafts per request."""
        self.spec_rounds += len(num_accepted)
        self.spec_drafted += num_draft_tokens * len(num_accepted)
        self.spec_accepted += sum(num_accepted)

    def add_step_time(self, mode: ForwardMode, seconds: float) -> None:
        name = mode.name.lower()
        self.step_counts[name] = self.step_counts.get(name, 0) + 1
        self.step_seconds[name] = self.step_seconds.get(name, 0.0) + seconds

    def take_step_times(self, interval_s: float) -> str:
        """', steps: decode 310 x 11.6 ms, extend 21 x 18.0 ms (95% of the time)' since the last call, or ''."""
        counts, seconds = self.step_counts, self.step_seconds
        self.step_counts, self.step_seconds = {}, {}
        if not counts:
            return ""
        parts = ", ".join(f"{m} {n} x {1e3 * seconds[m] / n:.1f} ms" for m, n in counts.items())
        return f", steps: {parts} ({100 * sum(seconds.values()) / interval_s:.0f}% of the time)"
