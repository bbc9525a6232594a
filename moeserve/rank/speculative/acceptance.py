"""The acceptance rules of a verify step: which drafted tokens a request keeps, and the token after them.

A request drafted d_1..d_k; the target's forward over [t, d_1..d_k] gave k + 1 rows of logits: row j is the
target's distribution for the token after d_j (row 0: after t). Each rule returns, per request, the tokens it
emits this round: the accepted drafts, then one token from the target (the correction at the first rejection, or
the bonus token after all k were accepted), so 1 to k + 1 tokens.

- Greedy (`accept_greedy`): the longest prefix of drafts equal to the target's argmax, then the target's argmax
  at the next row. The tokens are exactly those of plain greedy decoding.
- Sampling (`accept_sampled`), the standard speculative rule (Leviathan et al. 2023, Chen et al. 2023): accept d_j
  with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection emit a token drawn from
  norm(max(0, p_j - q_j)); after all k, draw the bonus from p_k. Every emitted token is then distributed as the
  target's p given the tokens before it. p is the target's distribution after the sampler's own processing
  (temperature, top-k, top-p, min-p: `processed_probs`, reusing rank/sampler.py's `filter_logits`), q the draft's
  distribution the drafts were drawn from (None: drafted deterministically, q is one-hot at the draft).

Randomness is the sampler's counter-based hash (rank/sampler.py's docstring): the token at output index s of a
request with seed z uses uniforms of (z, s), so a seeded request's round depends only on its seed, its position
and its own logits. The acceptance test's uniform comes from a stream of its own (the seed mixed with a salt),
independent of the Gumbel noise that draws the correction or bonus token.
"""

from __future__ import annotations

import dataclasses

import torch

from moeserve.rank.sampler import SamplingBatch, _as_int64, filter_logits, gumbel_noise, hash_uniform

_ACCEPT_SALT = _as_int64(0x5BD1E9955BD1E995)  # separates the acceptance uniforms from the Gumbel noise


def expand_rows(batch: SamplingBatch, rows_per_request: int) -> SamplingBatch:
    """The batch with each request's options repeated for its rows_per_request consecutive rows (a verify step's
    k + 1 rows per request); the step of row j of a request is its step + j."""
    n = rows_per_request
    assert batch.output_counts is None and batch.seen_mask is None and batch.token_mask is None, (
        "penalties and grammars are refused with speculative decoding")

    def rep(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(n, dim=0)

    offsets = torch.arange(n, dtype=torch.int64, device=batch.steps.device).repeat(batch.batch_size)
    return dataclasses.replace(
        batch, temperatures=rep(batch.temperatures), top_ps=rep(batch.top_ps), top_ks=rep(batch.top_ks),
        min_ps=rep(batch.min_ps), seeds=rep(batch.seeds), steps=rep(batch.steps) + offsets,
        is_greedy=rep(batch.is_greedy), num_generated=[g + j for g in batch.num_generated for j in range(n)])


def processed_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution the sampler draws from, [N, V] float32, for logits [N, V] (one row per row of `batch`):
    softmax of the temperature-scaled logits after top-k, top-p and min-p. Greedy rows: one-hot at the argmax."""
    logits = logits.float()
    probs = filter_logits(logits / batch.temperatures, batch).softmax(dim=-1)
    if batch.any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(batch.is_greedy[:, None], one_hot, probs)
    return probs


@dataclasses.dataclass
class Accepted:
    """One round's result for B requests with k drafts each."""

    tokens: torch.Tensor  # [B, k + 1] int64: row b's first num_emitted[b] entries are its tokens; the rest junk
    num_accepted: torch.Tensor  # [B] int64 in [0, k]: drafts kept (num_emitted = num_accepted + 1)

    @property
    def num_emitted(self) -> torch.Tensor:
        return self.num_accepted + 1

    def to_lists(self) -> list[list[int]]:
        """The emitted tokens per request (a host sync)."""
        rows, counts = self.tokens.tolist(), self.num_emitted.tolist()
        return [row[:n] for row, n in zip(rows, counts, strict=True)]


def _first_false(ok: torch.Tensor) -> torch.Tensor:
    """[B, k] bool -> [B] int64: the length of each row's leading run of True."""
    return ok.long().cumprod(dim=1).sum(dim=1)


def accept_greedy(drafts: torch.Tensor, target_ids: torch.Tensor) -> Accepted:
    """drafts [B, k] int64; target_ids [B, k + 1] int64, the target's argmax at each row. The emitted tokens are
    the target's own: the accepted drafts equal them, and the next is its argmax after them."""
    k = drafts.shape[1]
    assert target_ids.shape == (drafts.shape[0], k + 1), (drafts.shape, target_ids.shape)
    return Accepted(tokens=target_ids, num_accepted=_first_false(drafts == target_ids[:, :k]))


def accept_sampled(drafts: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                   seeds: torch.Tensor, steps: torch.Tensor) -> Accepted:
    """The speculative sampling rule (module docstring).

    drafts [B, k] int64; target_probs [B, k + 1, V] float32 (p, processed_probs of the target's rows);
    draft_probs [B, k, V] float32 (q; None: the drafts were chosen deterministically, q one-hot);
    seeds, steps [B] int64: the requests' seeds and output index of the round's first token.
    """
    batch_size, k = drafts.shape
    vocab_size = target_probs.shape[-1]
    assert target_probs.shape == (batch_size, k + 1, vocab_size), target_probs.shape
    offsets = torch.arange(k + 1, dtype=torch.int64, device=seeds.device)
    row_seeds = seeds.repeat_interleave(k + 1)  # [B * (k + 1)]: position j of a request is output index step + j
    row_steps = (steps[:, None] + offsets[None, :]).reshape(-1)

    p = target_probs[:, :k].gather(2, drafts[:, :, None]).squeeze(2)  # [B, k]: p_j(d_j)
    if draft_probs is None:
        q = torch.ones_like(p)
        residual = target_probs[:, :k].scatter(2, drafts[:, :, None], 0.0)  # max(0, p - one_hot(d))
    else:
        q = draft_probs.gather(2, drafts[:, :, None]).squeeze(2)
        residual = (target_probs[:, :k] - draft_probs).clamp(min=0.0)
    u = hash_uniform(row_seeds ^ _ACCEPT_SALT, row_steps, 1).view(batch_size, k + 1)[:, :k]
    # u < p / q, written without the division (q > 0 for every drawn draft; p = 0 never accepts)
    num_accepted = _first_false(u * q < p)

    # The token after the accepted run: from the residual at a rejection, from p_k after all k (the bonus). A
    # residual of all zeros (p == q there, so rejection had probability 0) cannot be reached; p keeps a row finite.
    rows = torch.cat([residual, target_probs[:, k:]], dim=1)  # [B, k + 1, V]
    at = rows.gather(1, num_accepted.view(batch_size, 1, 1).expand(batch_size, 1, vocab_size)).squeeze(1)
    fallback = target_probs.gather(1, num_accepted.view(batch_size, 1, 1).expand(batch_size, 1, vocab_size)).squeeze(1)
    at = torch.where(at.sum(dim=-1, keepdim=True) > 0, at, fallback)
    noise = gumbel_noise(row_seeds, row_steps, vocab_size).view(batch_size, k + 1, vocab_size)
    noise_at = noise.gather(1, num_accepted.view(batch_size, 1, 1).expand(batch_size, 1, vocab_size)).squeeze(1)
    last = (at.log() + noise_at).argmax(dim=-1)  # [B]: a draw from norm(at), Gumbel-max
    tokens = torch.cat([drafts, drafts[:, :1]], dim=1).scatter(1, num_accepted[:, None], last[:, None])
    return Accepted(tokens=tokens, num_accepted=num_accepted)
