"""DPController: which attention DP group gets each request.

With DP attention every group holds its own requests' KV cache, so a request goes to the group with the least
load: the tokens of the requests it was sent and has not finished (prompt + max_new_tokens, counted here the
moment a request is sent) plus the prompt tokens waiting in its queue, then its KV cache in use. The ranks'
own figures (LoadOut) come with every step's outputs and with each reply to GetLoadReq.
"""

from __future__ import annotations

from moeserve.rank.io_struct import LoadOut


class DPController:
    """Load per attention DP group, and the choice of a group for a new request.

    NOTE: not locked itself: the TokenizerManager calls assign and release under its own lock, with its
    per-request state; record_load is one list store, made from the receiver thread.
    """

    def __init__(self, num_dp: int):
        self.num_dp = num_dp
        # index: dp rank
        self.last_load: list[LoadOut] = [LoadOut(d, 0, 0, 0, 0, 0, 0) for d in range(num_dp)]
        self._live_tokens = [0] * num_dp  # tokens of requests sent to each DP group and not finished

    def record_load(self, load: LoadOut) -> None:
        """The latest load a group reported."""
        self.last_load[load.dp_rank] = load

    def pick_dp_rank(self) -> int:
        """The attention group with the least load: tokens of its live requests, then its KV usage."""
        return min(range(self.num_dp),
                   key=lambda d: (self._live_tokens[d] + self.last_load[d].num_waiting_tokens,
                                  self.last_load[d].kv_used_tokens))

    def assign(self, num_tokens: int, dp_rank: int | None = None) -> int:
        """The group for a new request of `num_tokens` (prompt + max_new_tokens), counted as live there: dp_rank
        when the request names one, else the least loaded."""
        dp_rank = self.pick_dp_rank() if dp_rank is None else dp_rank
        self._live_tokens[dp_rank] += num_tokens
        return dp_rank

    def release(self, dp_rank: int, num_tokens: int) -> None:
        """A request assigned to `dp_rank` finished or was aborted."""
        self._live_tokens[dp_rank] -= num_tokens
