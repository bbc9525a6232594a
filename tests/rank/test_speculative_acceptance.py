"""The acceptance rules of speculative decoding (rank/speculative/acceptance.py).

Greedy: against plain greedy decoding of a random Markov target, drafts right, wrong and mixed. Sampling: the
tokens a chain of rounds emits, over many seeded requests, follow the target's distribution after the sampler's
processing (temperature, top-k, top-p), checked by a chi-square test on the joint law of the first three tokens;
two wrong rules (keep every draft; draw the token after a rejection from p, not the residual) fail the same test.
"""

from __future__ import annotations

import math

import pytest
import torch

from moeserve.rank.sampler import SamplingBatch
from moeserve.rank.sampling_params import SamplingParams
from moeserve.rank.speculative.acceptance import (
    Accepted,
    accept_greedy,
    accept_sampled,
    expand_rows,
    processed_probs,
)

V = 5  # a small vocabulary: the joint law of 3 tokens has 125 cells
K = 3  # drafts per round


def _markov(seed: int, sharpness: float) -> torch.Tensor:
    """Logits [V, V] of a Markov chain: row a scores the token after token a."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=g) * sharpness


def test_greedy_matches_plain_greedy_decoding():
    g = torch.Generator().manual_seed(1)
    for trial in range(50):
        target = _markov(100 + trial, 2.0)
        batch = 8
        start = torch.randint(0, V, (batch,), generator=g)
        # drafts: the target's own chain, with random tokens swapped in at random places
        truth = [start]
        for _ in range(K + 1):
            truth.append(target[truth[-1]].argmax(dim=-1))
        truth = torch.stack(truth, dim=1)  # [B, K + 2]: t, then the plain greedy tokens
        drafts = truth[:, 1:K + 1].clone()
        wrong = torch.rand(batch, K, generator=g) < 0.3
        drafts[wrong] = torch.randint(0, V, (int(wrong.sum()),), generator=g)
        # the target's argmax after t, d_1, .., d_k (what a verify forward over [t, d_1..d_k] gives)
        inputs = torch.cat([start[:, None], drafts], dim=1)
        target_ids = target[inputs].argmax(dim=-1)
        out = accept_greedy(drafts, target_ids)
        for b, tokens in enumerate(out.to_lists()):
            n = len(tokens)
            assert tokens == truth[b, 1:n + 1].tolist()  # exactly plain greedy's next n tokens
            expected_accepted = 0
            while expected_accepted < K and drafts[b, expected_accepted] == truth[b, expected_accepted + 1]:
                expected_accepted += 1
            assert n == expected_accepted + 1


def test_greedy_hand_example():
    drafts = torch.tensor([[4, 1, 2], [4, 1, 2], [0, 0, 0]])
    target = torch.tensor([[4, 1, 2, 3], [4, 0, 2, 3], [1, 0, 0, 0]])
    assert accept_greedy(drafts, target).to_lists() == [[4, 1, 2, 3], [4, 0], [1]]


# ---------------------------------------------------------------------------------------------------------------
# The sampling rule: a statistical test
# ---------------------------------------------------------------------------------------------------------------


def _batch(n: int, params: SamplingParams) -> SamplingBatch:
    return SamplingBatch.build([params] * n, [[0]] * n, [[]] * n, V, "cpu")


def _run_rounds(rule, target_logits, draft_logits, params: SamplingParams, n: int, length: int,
                one_hot: bool = False) -> torch.Tensor:
    """n seeded requests starting from token 0, decoded by rounds of K drafts until each has `length` tokens:
    their first `length` tokens, [n, length]. The drafts are drawn from the draft chain's processed distribution
    (one_hot: its argmax, and the rule is told q is one-hot)."""
    batch = _batch(n, params)
    batch.seeds = torch.arange(n, dtype=torch.int64) * 7919 + 11
    out = torch.zeros(n, length + K + 1, dtype=torch.int64)
    count = torch.zeros(n, dtype=torch.int64)
    last = torch.zeros(n, dtype=torch.int64)
    expanded_draft = expand_rows(batch, 1)
    g = torch.Generator().manual_seed(5)
    while int(count.min()) < length:
        drafts, qs = [], []
        prev = last
        for _ in range(K):  # chain the draft model
            q = processed_probs(draft_logits[prev], expanded_draft)
            d = q.argmax(dim=-1) if one_hot else torch.multinomial(q, 1, generator=g).squeeze(1)
            drafts.append(d)
            qs.append(q)
            prev = d
        drafts = torch.stack(drafts, dim=1)
        q = torch.stack(qs, dim=1)  # [n, K, V]
        inputs = torch.cat([last[:, None], drafts], dim=1)  # the verify forward's [t, d_1..d_k]
        p = processed_probs(target_logits[inputs].reshape(n * (K + 1), V), expand_rows(batch, K + 1))
        acc: Accepted = rule(drafts, p.view(n, K + 1, V), None if one_hot else q, batch.seeds, count)
        emitted = acc.num_emitted
        cols = count[:, None] + torch.arange(K + 1)[None, :]
        keep = (torch.arange(K + 1)[None, :] < emitted[:, None]) & (cols < out.shape[1])
        out[keep.nonzero()[:, 0], cols[keep]] = acc.tokens[keep]
        last = acc.tokens.gather(1, (emitted - 1)[:, None]).squeeze(1)
        count = count + emitted
    return out[:, :length]


def _exact_law(target_logits: torch.Tensor, params: SamplingParams, length: int) -> torch.Tensor:
    """The target's joint law of its first `length` tokens from token 0, [V] * length, under the sampler's
    processing."""
    p = processed_probs(target_logits, expand_rows(_batch(V, params), 1))  # [V, V]: next-token law after a
    law = p[0]
    for _ in range(length - 1):
        law = torch.einsum("...a,ab->...ab", law, p)
    return law


def _chi_square_passes(samples: torch.Tensor, law: torch.Tensor) -> tuple[bool, float, float]:
    """Pearson's chi-square of the samples' joint counts against `law`, at a 1e-6 false-alarm level (the
    Wilson-Hilferty approximation of the quantile). Cells of tiny expectation are pooled into one."""
    n, length = samples.shape
    index = torch.zeros(n, dtype=torch.int64)
    for j in range(length):
        index = index * V + samples[:, j]
    observed = torch.bincount(index, minlength=V ** length).double()
    expected = law.reshape(-1).double() * n
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    if float(exp[-1]) < 5:  # the pooled cell is tiny too: fold it into the largest
        obs, exp = obs[:-1].clone(), exp[:-1].clone()
        obs[exp.argmax()] += observed[~big].sum()
        exp[exp.argmax()] += expected[~big].sum()
    stat = float(((obs - exp) ** 2 / exp.clamp(min=1e-12)).sum())
    df = len(exp) - 1
    z = 4.753  # the standard normal's 1 - 1e-6 quantile
    quantile = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < quantile, stat, quantile


def _keep_every_draft(drafts, target_probs, draft_probs, seeds, steps) -> Accepted:
    """A wrong rule: every draft is kept, the bonus drawn from the target."""
    n = drafts.shape[0]
    bonus = torch.multinomial(target_probs[:, -1], 1).squeeze(1)
    return Accepted(tokens=torch.cat([drafts, bonus[:, None]], dim=1),
                    num_accepted=torch.full((n,), drafts.shape[1], dtype=torch.int64))


def _correct_from_target(drafts, target_probs, draft_probs, seeds, steps) -> Accepted:
    """A subtly wrong rule: the right acceptance test, but the token after a rejection drawn from p, not from
    norm(max(0, p - q))."""
    right = accept_sampled(drafts, target_probs, draft_probs, seeds, steps)
    n, k = drafts.shape
    at = target_probs[torch.arange(n), right.num_accepted]
    last = torch.multinomial(at, 1).squeeze(1)
    tokens = right.tokens.scatter(1, right.num_accepted[:, None], last[:, None])
    return Accepted(tokens=tokens, num_accepted=right.num_accepted)


WRONG_RULES = {"keep_every_draft": _keep_every_draft, "correct_from_target": _correct_from_target}

PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8),
]


@pytest.mark.parametrize("params", PARAMS, ids=["plain", "top_k", "top_p"])
@pytest.mark.parametrize("drafted", ["sampled", "one_hot"])
def test_sampling_rule_gives_the_target_distribution(params, drafted):
    target = _markov(1, 1.5)
    draft = _markov(2, 1.5)  # a different chain: many rejections
    n, length = 60_000, 3
    law = _exact_law(target, params, length)
    assert torch.allclose(law.sum(), torch.tensor(1.0))
    one_hot = drafted == "one_hot"  # drafted deterministically: the draft chain's argmax
    samples = _run_rounds(accept_sampled, target, draft, params, n, length, one_hot)
    ok, stat, quantile = _chi_square_passes(samples, law)
    print(f"chi-square {stat:.1f}, quantile {quantile:.1f}")
    assert ok, f"chi-square {stat:.1f} over its 1e-6 quantile {quantile:.1f}"
    for name, wrong_rule in WRONG_RULES.items():
        wrong = _run_rounds(wrong_rule, target, draft, params, n, length, one_hot)
        ok, stat, quantile = _chi_square_passes(wrong, law)
        print(f"{name}: chi-square {stat:.1f}")
        assert not ok, f"the wrong rule {name} passed: chi-square {stat:.1f} under {quantile:.1f}"


def test_sampled_greedy_rows_follow_greedy():
    """A greedy request in the sampling rule's batch gets plain greedy's tokens."""
    target = _markov(3, 2.0)
    params = SamplingParams(temperature=0.0)
    batch = _batch(4, params)
    start = torch.tensor([0, 1, 2, 3])
    drafts = torch.tensor([[1, 2, 3], [0, 0, 0], [4, 4, 4], [2, 2, 1]])
    inputs = torch.cat([start[:, None], drafts], dim=1)
    p = processed_probs(target[inputs].reshape(-1, V), expand_rows(batch, K + 1)).view(4, K + 1, V)
    got = accept_sampled(drafts, p, None, batch.seeds, batch.steps).to_lists()
    want = accept_greedy(drafts, target[inputs].argmax(dim=-1)).to_lists()
    assert got == want
