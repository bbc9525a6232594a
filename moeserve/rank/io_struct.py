"""Messages between the server process (moeserve/server/rank_client.py) and the rank workers, sent over ZeroMQ as
pickles.

Server -> rank 0 of each attention group: GenerateReq, AbortReq, FlushCacheReq, GetLoadReq, ExpertDistributionReq,
ShutdownReq. Worker -> server: BatchTokenOut (token ids, never text: the server detokenizes), and one reply per
control request: LoadOut (to GetLoadReq), FlushCacheOut, ExpertDistributionOut.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field, fields
from typing import Any

from moeserve.eplb.rebalancer import RebalanceReport
from moeserve.rank.sampling_params import SamplingParams


@dataclass
class GenerateReq:
    """A tokenized request. `rid` is unique among live requests."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    stream: bool = False
    _: KW_ONLY  # the fields below are named at every call: new ones may come in any order
    # With return_logprob: the first prompt position to report logprobs for (-1: none; see prompt_logprobs.py)
    logprob_start_len: int = -1
    # PD disaggregation (sglang-router fields); None outside PD mode.
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    # PD mode: run on this server alone, as if colocated (the health check: /health_generate)
    local: bool = False


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    pass


@dataclass
class FlushCacheOut:
    success: bool
    message: str = ""


@dataclass
class GetLoadReq:
    pass


@dataclass
class LoadOut:
    """One attention group's load, for the DP controller and /get_load: the reply to GetLoadReq, and carried by
    every BatchTokenOut."""

    dp_rank: int
    num_running: int
    num_waiting: int
    num_waiting_tokens: int  # prompt tokens not yet prefilled
    kv_used_tokens: int
    kv_total_tokens: int
    num_cached_tokens: int  # tokens held by the radix cache (evictable)
    eplb: RebalanceReport | None = None  # rank 0 with --enable-eplb: the online rebalancer's counters
    disagg: dict[str, Any] | None = None  # PD mode: requests per state, KV transfers (disagg/stats.py)
    # --enable-hierarchical-cache: the host tier's tokens held and total, and its traffic since start
    # (HostKVPool.report: bytes_to_host, bytes_to_device, load_back_seconds)
    hicache: dict[str, Any] | None = None
    # steps this group ran, by kind: "static_decode" (padded to the agreed size, rank/static_shape.py), and with
    # --enable-two-batch-overlap "tbo N" / "no_tbo N" (steps whose largest group had N tokens, overlapped or not)
    step_counts: dict[str, int] = field(default_factory=dict)
    # speculative decoding, cumulative: verify rounds (one per request per verify step), drafted and accepted
    # drafts (rank/speculative/); None without it
    spec: tuple[int, int, int] | None = None

    def to_json(self) -> dict[str, Any]:
        """The group's load as /get_load and /get_server_info show it (the rebalancer's counters go to /metrics)."""
        apart = ("eplb", "disagg", "hicache", "step_counts", "spec")
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in apart}
        if self.disagg is not None:
            out["disagg"] = self.disagg
        if self.hicache is not None:
            out["hicache"] = self.hicache
        if self.step_counts:
            out["step_counts"] = self.step_counts
        return out


@dataclass
class ExpertDistributionReq:
    """start, stop or dump the expert-distribution recording (moeserve/eplb/recorder.py)."""

    action: str


@dataclass
class ExpertDistributionOut:
    """One attention group's answer: its part of the dump (moeserve/eplb/recorder.py `dump`) for dump, or an
    error."""

    dp_rank: int
    mode: str = "stat"
    dump: dict[str, Any] | None = None
    error: str = ""


@dataclass
class ShutdownReq:
    pass


@dataclass
class FinishReason:
    """Why a request ended: 'stop' (EOS, stop token or stop string), 'length', or 'abort'."""

    type: str
    matched: int | str | None = None  # the stop token id or stop string
    message: str | None = None  # for 'abort': why
    # for an 'abort' that is a failure, not a request to stop: the HTTP status the server answers (as SGLang's
    # FINISH_ABORT carries one): 400 for a request the rank refuses, 500 for non-finite logits
    status_code: int | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.type}
        if self.matched is not None:
            d["matched"] = self.matched
        if self.message is not None:
            d["message"] = self.message
        if self.status_code is not None:
            d["status_code"] = self.status_code
        return d


@dataclass
class TokenOut:
    """New output tokens of one request since the last message (possibly none, when only finishing)."""

    rid: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_tokens_details: dict[str, int] | None = None  # hierarchical cache: cached_tokens by tier (device, host[, storage])
    # With return_logprob: one entry per new token.
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # With logprob_start_len >= 0: the prompt's, positions logprob_start_len .. len - 1 (None at position 0),
    # once, in the first output after the prompt is scored.
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]]] | None = None
    spec_verify_ct: int | None = None  # speculative decoding: the request's verify steps so far (SGLang's field)


@dataclass
class BatchTokenOut:
    """Everything one scheduler step produced, plus its load for the DP controller and metrics."""

    outputs: list[TokenOut] = field(default_factory=list)
    load: LoadOut | None = None


@dataclass
class WorkerError:
    """A worker's fatal error: the server marks itself unhealthy and fails requests with this message."""

    rank: int
    message: str
