"""Prompt logprobs: the log-probability of each prompt token given the tokens before it, computed in prefill.

A request asks with return_logprob and logprob_start_len = s >= 0 (SGLang's fields). It gets, for prompt positions
i in [s, len(prompt)), log p(token_i | tokens before i) (None at i = 0, which nothing predicts), and with
top_logprobs_num = n the n most likely tokens at i. The logits at position p score token p + 1, so prefill runs
positions [max(s, 1) - 1, len(prompt) - 1) through the LM head as well as the last one (which samples):
the scheduler puts those rows of each chunk first in logits_indices, and the worker scores them here before
sampling from the rest. Chunked prefill scores each chunk's positions as the chunk runs.

The radix cache: positions that must be scored are never taken from the cache (a cached prefix of such a
request ends at or before position max(s, 1) - 1, rounded down to a page), so they are computed, not
recomputed on the side; the tokens before them are still shared. A request retracted after its prompt was
scored is not scored again.

Raw log-probabilities of the model's distribution (temperature 1, no penalties or filters), as for output
tokens (sampler.py).
"""

from __future__ import annotations

import torch


def first_scored_position(logprob_start_len: int) -> int:
    """The first position whose logits a request with this logprob_start_len (>= 0) needs."""
    return max(logprob_start_len, 1) - 1


def scored_positions(next_position: int, prompt_len: int, chunk_start: int, chunk_len: int) -> range:
    """Positions p of the chunk [chunk_start, chunk_start + chunk_len) whose logits score a prompt token p + 1,
    from next_position on (the first one not yet scored)."""
    return range(max(chunk_start, next_position), min(chunk_start + chunk_len, prompt_len - 1))


def score(logits: torch.Tensor, target_ids: list[int], top_ns: list[int]
          ) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """logits [R, V] float32 of R positions, target_ids [R] the token each position predicts, top_ns [R] the
    alternatives to report per row -> (logprob of each target [R], [R][n_r] (token id, logprob) largest first)."""
    assert logits.shape[0] == len(target_ids) == len(top_ns)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(target_ids, dtype=torch.int64, device=logits.device)
    chosen = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in target_ids]
    max_n = max(top_ns, default=0)
    if max_n > 0:
        values, ids = logprobs.topk(min(max_n, logprobs.shape[1]), dim=-1)
        values, ids = values.tolist(), ids.tolist()
        tops = [list(zip(ids[r][:n], values[r][:n], strict=True)) for r, n in enumerate(top_ns)]
    return chosen, tops
