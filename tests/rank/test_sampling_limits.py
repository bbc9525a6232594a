"""The sampler at the edges: extreme but valid parameters give an answer, non-finite logits give no token (never
token 0)."""

from __future__ import annotations

import pytest

from moeserve.rank.sampler import sample
from moeserve.rank.sampling_params import SamplingParams
from tests.rank.test_sampling import DEVICES, _batch, _logits


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.mark.parametrize("top_p", [1e-46, 1e-45, 1e-30, 1e-9])
def test_tiny_top_p_keeps_the_likeliest_token(device, top_p):
    logits = _logits(8, 300, seed=21).to(device)
    out = sample(logits, _batch([SamplingParams(top_p=top_p, seed=i) for i in range(8)], 300, device))
    assert out.next_token_ids == logits.argmax(-1).tolist()


def test_tiny_repetition_penalty_favours_seen_tokens(device):
    from moeserve.rank.sampler import NO_TOKEN

    logits = _logits(4, 200, seed=22).to(device)
    prompts = [[5, 6, 7, 8]] * 4
    params = [SamplingParams(repetition_penalty=1e-300, temperature=t) for t in (0.0, 1.0, 0.0, 0.7)]
    out = sample(logits, _batch(params, 200, device, prompts=prompts))
    for b, tok in enumerate(out.next_token_ids):
        assert tok != NO_TOKEN
        seen_positive = [t for t in prompts[b] if logits[b, t] > 0]
        if seen_positive:  # logit / ~0 outweighs every unseen token
            assert tok == max(seen_positive, key=lambda t: logits[b, t].item())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_give_no_token(device, bad):
    from moeserve.rank.sampler import NO_TOKEN

    logits = _logits(4, 100, seed=23)
    logits[1, 17] = bad
    logits[3, :] = float("-inf")  # nothing left to choose
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0), SamplingParams(seed=1),
              SamplingParams(seed=2)]
    out = sample(logits.to(device), _batch(params, 100, device))
    assert out.next_token_ids[1] == NO_TOKEN and out.next_token_ids[3] == NO_TOKEN
    assert out.next_token_ids[0] == logits[0].argmax().item()
    assert 0 <= out.next_token_ids[2] < 100
    sampled = [SamplingParams(seed=i) for i in range(4)]
    out = sample(logits.to(device), _batch(sampled, 100, device))
    assert out.next_token_ids[1] == NO_TOKEN and out.next_token_ids[3] == NO_TOKEN
