"""The sampler: next tokens (and their log-probabilities) from one step's logits, vectorized over the batch.

Per step the model runner builds a `SamplingBatch` from the requests' `SamplingParams` and token lists, then
calls `sample(logits, batch)`. Everything runs on the logits' device; the host sees only the chosen ids and
the requested log-probabilities.

Order of processing, for each row of logits [B, V]:
    grammar mask -> penalties (repetition, then frequency/presence) -> temperature -> top-k -> top-p -> min-p -> draw
- The grammar mask (structured outputs, moeserve/constrained/) sets the tokens a constrained row's grammar does not
  allow to -inf, on those rows only: the other rows' tokens are those of a batch without them.
- Greedy rows (temperature < GREEDY_TEMPERATURE, or top_k == 1) take the argmax of the penalized logits;
  every row's choice, with its NO_TOKEN check, is one op (kernels/argmax.py: a Triton kernel on CUDA).
- Every filter keeps the likeliest token, so a row always has one to choose; a row whose logits hold NaN or +inf
  (or nothing but -inf) gets NO_TOKEN, and the scheduler fails that request instead of sampling token 0.
- top-p keeps the smallest prefix (by probability, highest first) whose mass reaches top_p, measured on the
  distribution left after top-k (renormalized), as vLLM does. min-p keeps tokens whose probability is at
  least min_p times the largest; that ratio does not depend on renormalization, so min-p after top-p simply
  intersects.
- Log-probabilities are those of the model's raw logits: log_softmax before the grammar mask, penalties,
  temperature and filters (vLLM's default "raw logprobs"). `logprobs[b]` is the chosen token's; `top_logprobs[b]` the
  n largest, sorted, whatever was filtered.

Randomness. Draws use the Gumbel-max trick, argmax(logits / T + g), with g = -log(-log(u)) and u a uniform
from a counter-based hash of (seed, step, token id), step = tokens the request has generated so far. So a
seeded request's tokens depend only on its seed, its step and its own logits: the same whatever else is in the
batch, in whatever order, on the same device (and the integer hash is the same on every device). No
torch.Generator per request, no host work per vocabulary entry. Unseeded requests get a fresh seed each step
from a host `random.Random` (`rng` in `SamplingBatch.build`); give every rank of a tensor-parallel group the
same seeded rng (ServerArgs.random_seed) and they draw the same tokens.

Uniforms have 23 bits, u = (k + 0.5) / 2**23, so g lies in about [-2.8, 16.6]; the resulting error in any
token's probability is far below 1e-6, well under what float32 softmax resolves.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from moeserve.kernels.argmax import argmax_or_none
from moeserve.rank.penalties import apply_penalties, build_token_counts, build_token_mask
from moeserve.rank.sampling_params import SamplingParams

if TYPE_CHECKING:
    from moeserve.constrained.base import TokenMask

NO_TOKEN = -1  # next_token_ids of a row whose logits were not finite
# Repetition penalties below this are taken as this: a smaller one underflows float32 (1e-300 is 0, and logit / 0
# is inf); at 1e-30 the seen tokens with positive logits already outweigh all others.
MIN_REPETITION_PENALTY = 1e-30
_MASK64 = (1 << 64) - 1
_DEFAULT_RNG = random.Random(0)  # unseeded requests when the caller passes no rng; see module docstring


def _as_int64(x: int) -> int:
    """x modulo 2**64, as a signed 64-bit integer (what an int64 tensor holds)."""
    x &= _MASK64
    return x - (1 << 64) if x >= (1 << 63) else x


# splitmix64 constants, written as the int64 values of their bit patterns.
_GAMMA = _as_int64(0x9E3779B97F4A7C15)
_MIX1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX2 = _as_int64(0x94D049BB133111EB)
_UNIFORM_BITS = 23  # (k + 0.5) / 2**23 is exact in float32 and strictly inside (0, 1)


# ---------------------------------------------------------------------------------------------------------------
# SamplingBatch
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class SamplingBatch:
    """One step's sampling options for B requests over a vocabulary of V tokens, as tensors on the device."""

    vocab_size: int
    temperatures: torch.Tensor  # [B, 1] float32; 1.0 on greedy rows (they take the argmax instead)
    top_ps: torch.Tensor  # [B] float32; 2.0 where top_p == 1, so the rounding of a cumsum never drops a token
    top_ks: torch.Tensor  # [B] int64 in [1, V]; V where top_k == -1
    min_ps: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64: the request's seed mod 2**64, or a fresh one from `rng` if unseeded
    steps: torch.Tensor  # [B] int64: tokens generated so far (= num_generated)
    is_greedy: torch.Tensor  # [B] bool
    num_generated: list[int]  # host copy of `steps`
    all_greedy: bool  # fast path: plain argmax, no noise, no filters
    any_greedy: bool
    need_top_k: bool  # some sampled (non-greedy) row filters by top-k; likewise below
    need_top_p: bool
    need_min_p: bool
    # Penalties; None when no request of the batch uses them.
    frequency_penalties: torch.Tensor | None = None  # [B, 1] float32
    presence_penalties: torch.Tensor | None = None  # [B, 1] float32
    output_counts: torch.Tensor | None = None  # [B, V] int32, occurrences of each token in the output
    repetition_penalties: torch.Tensor | None = None  # [B, 1] float32
    seen_mask: torch.Tensor | None = None  # [B, V] bool, token occurs in prompt or output
    token_mask: TokenMask | None = None  # the constrained rows' allowed tokens (None: no row has a grammar)

    @property
    def batch_size(self) -> int:
        return len(self.num_generated)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        vocab_size: int,
        device: torch.device | str,
        rng: random.Random | None = None,
    ) -> SamplingBatch:
        """Gather the requests' options into device tensors (two small host-to-device copies, plus the
        token-count tensors when some request has penalties).

        params, prompt_ids, output_ids: one entry per request, in the row order of the logits.
        rng: source of seeds for unseeded requests (a module-level Random(0) if None).
        """
        batch_size = len(params)
        assert len(prompt_ids) == batch_size and len(output_ids) == batch_size
        rng = rng if rng is not None else _DEFAULT_RNG

        floats: list[list[float]] = []  # temperature, top_p, min_p, frequency, presence, repetition
        ints: list[list[int]] = []  # seed, step, top_k, is_greedy
        num_generated = [len(o) for o in output_ids]
        need_top_k = need_top_p = need_min_p = need_counts = need_seen = False
        for p, step in zip(params, num_generated, strict=True):
            greedy = p.is_greedy
            top_k = vocab_size if p.top_k == -1 else min(p.top_k, vocab_size)
            seed = p.seed if p.seed is not None else rng.getrandbits(64)
            floats.append(
                [
                    1.0 if greedy else p.temperature,
                    p.top_p if p.top_p < 1.0 else 2.0,
                    p.min_p,
                    p.frequency_penalty,
                    p.presence_penalty,
                    max(p.repetition_penalty, MIN_REPETITION_PENALTY),
                ]
            )
            ints.append([_as_int64(seed), step, top_k, int(greedy)])
            if not greedy:
                need_top_k |= top_k < vocab_size
                need_top_p |= p.top_p < 1.0
                need_min_p |= p.min_p > 0.0
            need_counts |= p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
            need_seen |= p.repetition_penalty != 1.0

        # non_blocking: a plain copy would wait for the device to finish the forward queued before it
        f = torch.tensor(floats, dtype=torch.float32).reshape(batch_size, 6).to(device, non_blocking=True)
        i = torch.tensor(ints, dtype=torch.int64).reshape(batch_size, 4).to(device, non_blocking=True)
        greedy_flags = [bool(row[3]) for row in ints]
        batch = cls(
            vocab_size=vocab_size,
            temperatures=f[:, 0:1],
            top_ps=f[:, 1],
            min_ps=f[:, 2],
            seeds=i[:, 0],
            steps=i[:, 1],
            top_ks=i[:, 2],
            is_greedy=i[:, 3].bool(),
            num_generated=num_generated,
            all_greedy=all(greedy_flags),
            any_greedy=any(greedy_flags),
            need_top_k=need_top_k,
            need_top_p=need_top_p,
            need_min_p=need_min_p,
        )
        if need_counts:
            batch.frequency_penalties = f[:, 3:4]
            batch.presence_penalties = f[:, 4:5]
            batch.output_counts = build_token_counts(output_ids, vocab_size, device)
        if need_seen:
            batch.repetition_penalties = f[:, 5:6]
            batch.seen_mask = build_token_mask(prompt_ids, output_ids, vocab_size=vocab_size, device=device)
        return batch


# ---------------------------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class SampleOutput:
    next_token_ids: list[int]  # [B]; NO_TOKEN where the row's logits were not finite; [] until read (to_host)
    logprobs: list[float] | None  # [B] raw log-prob of each chosen token; None unless asked for
    top_logprobs: list[list[tuple[int, float]]]  # [B][n_b] (token id, raw log-prob), largest first
    next_token_ids_device: torch.Tensor  # [B] int64 on the logits' device, for the next step's input
    # to_host=False: the tensors the lists above are read from later ("ids", and "logprobs", "top_values",
    # "top_ids" when asked for), on the device, and the alternatives each row reports
    device: dict[str, torch.Tensor] = field(default_factory=dict)
    top_logprobs_num: list[int] = field(default_factory=list)

    def read(self, host: dict[str, torch.Tensor]) -> None:
        """Fill the lists from host copies of `device` (the same keys)."""
        self.next_token_ids = host["ids"].tolist()
        if "logprobs" in host:
            self.logprobs = host["logprobs"].tolist()
        if "top_values" in host:
            values, ids = host["top_values"].tolist(), host["top_ids"].tolist()
            self.top_logprobs = [list(zip(ids[b][:n], values[b][:n], strict=True))
                                 for b, n in enumerate(self.top_logprobs_num)]


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    top_logprobs_num: list[int] | int = 0,
    return_logprob: bool = True,
    to_host: bool = True,
) -> SampleOutput:
    """Choose one token per row of `logits` ([B, V] float32, one row per request of `batch`).

    top_logprobs_num: alternatives to report per request (an int for all, or one per request; 0 = none).
    return_logprob: compute the chosen tokens' log-probs (skip it to save a log_softmax when nobody asks).
    to_host: read the tokens (and logprobs) on the host, a sync; False leaves them in `device` for SampleOutput.read.
    The input logits are not modified.
    """
    batch_size, vocab_size = logits.shape
    assert batch_size == batch.batch_size and vocab_size == batch.vocab_size, (logits.shape, batch.batch_size)
    nums = [top_logprobs_num] * batch_size if isinstance(top_logprobs_num, int) else list(top_logprobs_num)
    assert len(nums) == batch_size and all(n >= 0 for n in nums)
    logits = logits.float()

    masked = batch.token_mask.apply(logits) if batch.token_mask is not None else logits
    penalized = apply_penalties(
        masked,
        output_counts=batch.output_counts,
        frequency_penalties=batch.frequency_penalties,
        presence_penalties=batch.presence_penalties,
        seen_mask=batch.seen_mask,
        repetition_penalties=batch.repetition_penalties,
    )
    if batch.all_greedy:
        scores = penalized
    else:
        scaled = penalized / batch.temperatures
        scores = filter_logits(scaled, batch) + gumbel_noise(batch.seeds, batch.steps, vocab_size)
        if batch.any_greedy:
            scores = torch.where(batch.is_greedy[:, None], penalized, scores)
    # A row whose winning score is not finite (a NaN, +inf, or nothing left to choose) has no token to give:
    # NO_TOKEN, and the scheduler fails the request (never token 0).
    next_ids = argmax_or_none(scores, NO_TOKEN)

    device = {"ids": next_ids}
    max_num = max(nums, default=0)
    if return_logprob or max_num > 0:
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        if return_logprob:
            # a NO_TOKEN row's log-prob is never read (the scheduler fails that request): any index will do
            device["logprobs"] = raw_logprobs.gather(1, next_ids.clamp(min=0)[:, None]).squeeze(1)
        if max_num > 0:  # sorted, largest first
            device["top_values"], device["top_ids"] = raw_logprobs.topk(min(max_num, vocab_size), dim=-1)
    out = SampleOutput(next_token_ids=[], logprobs=None, top_logprobs=[[] for _ in range(batch_size)],
                       next_token_ids_device=next_ids, device=device, top_logprobs_num=nums)
    if to_host:
        out.read(device)
    return out


def filter_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature-scaled logits [B, V] with tokens outside top-k, top-p and min-p set to -inf (a new tensor).

    Each filter keeps a prefix of the tokens sorted by logit, so one stable sort serves all three.
    """
    if not (batch.need_top_k or batch.need_top_p):
        if not batch.need_min_p:
            return logits
        # p < min_p * p_max  <=>  logit < logit_max + log(min_p); min_p = 0 gives -inf and keeps everything.
        threshold = logits.amax(dim=-1, keepdim=True) + torch.log(batch.min_ps)[:, None]
        return logits.masked_fill(logits < threshold, float("-inf"))

    vocab_size = logits.shape[-1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
    if batch.need_top_k:
        positions = torch.arange(vocab_size, device=logits.device)
        sorted_logits.masked_fill_(positions[None, :] >= batch.top_ks[:, None], float("-inf"))
    if batch.need_top_p:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
        # The likeliest token always stays: a top_p that rounds to 0 in float32 (1e-46) means greedy, not nothing.
        drop = mass_before >= batch.top_ps[:, None]
        drop[:, 0] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    if batch.need_min_p:
        threshold = sorted_logits[:, :1] + torch.log(batch.min_ps)[:, None]
        sorted_logits.masked_fill_(sorted_logits < threshold, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


# ---------------------------------------------------------------------------------------------------------------
# Counter-based noise
# ---------------------------------------------------------------------------------------------------------------


def _shift_right(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic: mask off the copied sign bits)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer, a bijection on 64-bit patterns; int64 multiplication wraps modulo 2**64."""
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def hash_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms in (0, 1), [B, V] float32, a pure function of (seeds[b], steps[b], token id).

    seeds, steps: [B] int64. Row b is the splitmix64 stream that starts from a key mixed from its seed and step.
    """
    keys = _mix64(_mix64(seeds) + (steps + 1) * _GAMMA)  # [B]
    counters = (torch.arange(vocab_size, dtype=torch.int64, device=seeds.device) + 1) * _GAMMA  # [V]
    bits = _mix64(keys[:, None] + counters[None, :])  # [B, V]
    k = _shift_right(bits, 64 - _UNIFORM_BITS)
    return (k.float() + 0.5) * (1.0 / (1 << _UNIFORM_BITS))


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [B, V] float32: argmax(logits + noise) draws from softmax(logits)."""
    return -torch.log(-torch.log(hash_uniform(seeds, steps, vocab_size)))
