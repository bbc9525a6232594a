"""SamplingParams validation and the sampler: filters, distributions, seeds, penalties, logprobs.

Statistical tests draw from fixed seeds, so they are deterministic; their bounds are stated where they are
asserted and are loose enough that any correct sampler passes for almost every seed.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeserve.rank.penalties import apply_penalties, build_token_counts, build_token_mask
from moeserve.rank.sampler import SamplingBatch, hash_uniform, sample
from moeserve.rank.sampling_params import SamplingParams

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def _logits(batch_size: int, vocab_size: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch_size, vocab_size, generator=g) * scale


def _batch(params, vocab_size, device, prompts=None, outputs=None, rng_seed=0) -> SamplingBatch:
    n = len(params)
    prompts = prompts if prompts is not None else [[1, 2, 3]] * n
    outputs = outputs if outputs is not None else [[]] * n
    return SamplingBatch.build(params, prompts, outputs, vocab_size, device, rng=random.Random(rng_seed))


def _draw_repeated(
    row: torch.Tensor, params: SamplingParams, num_draws: int, device, rng_seed=0
) -> list[int]:
    """`num_draws` independent draws from one logits row: a batch of that many copies, unseeded."""
    logits = row[None, :].repeat(num_draws, 1).to(device)
    batch = _batch([params] * num_draws, row.numel(), device, rng_seed=rng_seed)
    return sample(logits, batch, return_logprob=False).next_token_ids


def _total_variation(draws: list[int], probs: torch.Tensor) -> float:
    counts = Counter(draws)
    n = len(draws)
    return 0.5 * sum(abs(counts.get(v, 0) / n - probs[v].item()) for v in range(probs.numel()))


def _chi_square(draws: list[int], probs: torch.Tensor) -> float:
    counts = Counter(draws)
    n = len(draws)
    return sum((counts.get(v, 0) - n * p) ** 2 / (n * p) for v, p in enumerate(probs.tolist()) if p > 0)


# ---------------------------------------------------------------------------------------------------------------
# SamplingParams
# ---------------------------------------------------------------------------------------------------------------


def test_defaults_are_sglangs():
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, -1, 0.0)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.seed, p.n, p.no_stop_trim) == (
        None,
        None,
        False,
        None,
        1,
        False,
    )
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    p.validate(vocab_size=10)


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("max_new_tokens", -1, ">= 0"),
        ("max_new_tokens", 1.5, "integer"),
        ("max_new_tokens", None, "integer"),
        ("temperature", -0.1, ">= 0"),
        ("temperature", float("nan"), ">= 0"),
        ("temperature", "hot", "number"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.01, "(0, 1]"),
        ("top_k", 0, "-1"),
        ("top_k", -2, "-1"),
        ("top_k", 2.0, "integer"),
        ("min_p", -0.01, "[0, 1]"),
        ("min_p", 1.5, "[0, 1]"),
        ("frequency_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", -2.01, "[-2, 2]"),
        ("presence_penalty", -3.0, "[-2, 2]"),
        ("presence_penalty", float("inf"), "[-2, 2]"),
        ("repetition_penalty", 0.0, "> 0"),
        ("repetition_penalty", -1.0, "> 0"),
        ("repetition_penalty", 2.5, "(0, 2]"),
        ("stop", 5, "string"),
        ("stop", ["ok", ""], "non-empty"),
        ("stop", ["ok", 3], "string"),
        ("stop_token_ids", [1, -1], ">= 0"),
        ("stop_token_ids", [1, "2"], "integers"),
        ("stop_token_ids", 7, "list"),
        ("ignore_eos", "yes", "true or false"),
        ("skip_special_tokens", 1, "true or false"),
        ("seed", 1.5, "integer"),
        ("seed", "42", "integer"),
        ("seed", True, "integer"),
        ("n", 0, ">= 1"),
        ("n", True, ">= 1"),
    ],
)
def test_validate_rejects_bad_field(field, value, fragment):
    p = SamplingParams(**{field: value})
    with pytest.raises(ValueError) as e:
        p.validate()
    assert field in str(e.value) and fragment in str(e.value)


def test_validate_stop_token_ids_against_vocab():
    SamplingParams(stop_token_ids=[0, 99]).validate(vocab_size=100)
    with pytest.raises(ValueError, match=r"stop_token_ids .*< vocab_size 100.*100"):
        SamplingParams(stop_token_ids=[0, 100]).validate(vocab_size=100)


def test_validate_accepts_edges():
    SamplingParams(
        max_new_tokens=0,
        temperature=0,
        top_p=1,
        top_k=1,
        min_p=1,
        frequency_penalty=-2,
        presence_penalty=2,
        repetition_penalty=1e-3,
        seed=-(2**70),
        n=4,
        stop="x",
    ).validate()


def test_from_dict_rejects_unknown_keys_and_lists_them():
    with pytest.raises(ValueError) as e:
        SamplingParams.from_dict({"temperature": 0.5, "lora_path": "a+", "logit_bias": "{}"})
    msg = str(e.value)
    assert "logit_bias, lora_path" in msg and "supported keys" in msg and "temperature" in msg


def test_from_dict_validates_and_builds():
    p = SamplingParams.from_dict({"temperature": 0, "top_k": 5, "stop": "\n", "seed": 7})
    assert (p.temperature, p.top_k, p.stop, p.seed) == (0, 5, "\n", 7)
    assert p.is_greedy
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_dict({"top_p": None})
    with pytest.raises(ValueError, match="JSON object"):
        SamplingParams.from_dict([("top_p", 0.5)])


def test_normalized_lists():
    assert SamplingParams().normalized().stop == []
    assert SamplingParams().normalized().stop_token_ids == []
    p = SamplingParams(stop="END", stop_token_ids=[3])
    n = p.normalized()
    assert n.stop == ["END"] and n.stop_token_ids == [3] and p.stop == "END"
    assert SamplingParams(stop=("a", "b")).normalized().stop == ["a", "b"]
    assert SamplingParams(stop=["a"]).stop_strs == ["a"]


_valid_params = st.builds(
    SamplingParams,
    max_new_tokens=st.integers(0, 10_000),
    temperature=st.floats(0, 5),
    top_p=st.floats(1e-6, 1),
    top_k=st.one_of(st.just(-1), st.integers(1, 1000)),
    min_p=st.floats(0, 1),
    frequency_penalty=st.floats(-2, 2),
    presence_penalty=st.floats(-2, 2),
    repetition_penalty=st.floats(1e-3, 2),  # SGLang's range, (0, 2]
    stop=st.one_of(st.none(), st.text(min_size=1), st.lists(st.text(min_size=1), max_size=3)),
    stop_token_ids=st.one_of(st.none(), st.lists(st.integers(0, 99), max_size=4)),
    seed=st.one_of(st.none(), st.integers()),
    n=st.integers(1, 8),
)


@settings(max_examples=200, deadline=None)
@given(_valid_params)
def test_valid_params_validate_and_round_trip(p):
    p.validate(vocab_size=100)
    assert SamplingParams.from_dict(dataclasses.asdict(p)) == p


# ---------------------------------------------------------------------------------------------------------------
# Greedy and the softmax distribution
# ---------------------------------------------------------------------------------------------------------------


def test_temperature_zero_is_argmax(device):
    logits = _logits(64, 1000, seed=1).to(device)
    params = [SamplingParams(temperature=0.0, seed=i) for i in range(64)]
    out = sample(logits, _batch(params, 1000, device))
    assert out.next_token_ids == logits.argmax(-1).tolist()


def test_greedy_rows_inside_a_sampled_batch_are_argmax(device):
    logits = _logits(32, 500, seed=2).to(device)
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.8, top_k=1 if i % 4 == 2 else -1, top_p=0.9)
        for i in range(32)
    ]
    out = sample(logits, _batch(params, 500, device))
    argmax = logits.argmax(-1).tolist()
    for i, p in enumerate(params):
        if p.is_greedy:
            assert out.next_token_ids[i] == argmax[i]


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_unfiltered_draws_follow_softmax(device, temperature):
    # 20000 draws over 10 tokens. Expected total variation for a correct sampler ~0.009; bound 0.02.
    # Chi-square with 9 degrees of freedom: 27.88 is its 0.999 quantile.
    row = _logits(1, 10, seed=3, scale=1.0)[0]
    probs = torch.softmax(row.double() / temperature, -1)
    draws = _draw_repeated(row, SamplingParams(temperature=temperature), 20_000, device, rng_seed=4)
    assert _total_variation(draws, probs) < 0.02
    assert _chi_square(draws, probs) < 27.88


def test_seeded_draws_across_seeds_follow_softmax(device):
    # The same, with seeds 0..19999 (all at step 0): the hash is a good generator across seeds.
    row = _logits(1, 10, seed=5, scale=1.0)[0]
    probs = torch.softmax(row.double(), -1)
    n = 20_000
    params = [SamplingParams(seed=s) for s in range(n)]
    draws = sample(row[None].repeat(n, 1).to(device), _batch(params, 10, device), return_logprob=False)
    assert _total_variation(draws.next_token_ids, probs) < 0.02
    assert _chi_square(draws.next_token_ids, probs) < 27.88


def test_hash_uniform_is_uniform_across_steps_and_tokens(device):
    # One seed, 2000 steps x 64 tokens = 128000 uniforms in 16 equal bins: chi-square (15 dof) below 37.70
    # (its 0.999 quantile); mean within 0.005 of 1/2; adjacent tokens uncorrelated (|r| < 0.02).
    steps = torch.arange(2000, dtype=torch.int64, device=device)
    seeds = torch.full_like(steps, 123456789)
    u = hash_uniform(seeds, steps, 64).cpu().double()
    assert ((u > 0) & (u < 1)).all()
    bins = torch.bincount((u * 16).long().flatten(), minlength=16).double()
    expected = u.numel() / 16
    assert ((bins - expected) ** 2 / expected).sum().item() < 37.70
    assert abs(u.mean().item() - 0.5) < 0.005
    a, b = u[:, :-1].flatten() - 0.5, u[:, 1:].flatten() - 0.5
    assert abs((a * b).mean().item() / (a * a).mean().item()) < 0.02
    # rows (steps) differ from each other
    assert len({tuple(r) for r in u[:50].tolist()}) == 50


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hash_is_the_same_on_cpu_and_cuda():
    # int64 arithmetic wraps the same way on both, so a seed draws the same tokens on either device.
    seeds = torch.tensor([0, 1, -1, 2**62, -(2**63), 123456789], dtype=torch.int64)
    steps = torch.tensor([0, 5, 1000, 3, 7, 2**40], dtype=torch.int64)
    cpu = hash_uniform(seeds, steps, 5000)
    cuda = hash_uniform(seeds.cuda(), steps.cuda(), 5000).cpu()
    assert torch.equal(cpu, cuda)


# ---------------------------------------------------------------------------------------------------------------
# Filters
# ---------------------------------------------------------------------------------------------------------------


def _ranks(row: torch.Tensor) -> dict[int, int]:
    order = torch.argsort(row, descending=True, stable=True).tolist()
    return {tok: r for r, tok in enumerate(order)}


def test_top_k_never_leaves_the_k_largest(device):
    vocab, k = 64, 5
    row = _logits(1, vocab, seed=6)[0]
    draws = _draw_repeated(row, SamplingParams(temperature=1.3, top_k=k), 10_000, device, rng_seed=7)
    ranks = _ranks(row)
    assert {ranks[t] for t in draws} == set(range(k))  # only the top k, and every one of them
    # Within the k: the renormalized softmax. 10000 draws over 5 tokens: total variation < 0.02.
    keep = torch.topk(row, k).indices
    probs = torch.zeros(vocab, dtype=torch.float64)
    probs[keep] = torch.softmax(row[keep].double() / 1.3, -1)
    assert _total_variation(draws, probs) < 0.02


def test_per_row_top_k(device):
    vocab, n = 200, 3000
    logits = _logits(n, vocab, seed=8)
    ks = [1 + i % 17 for i in range(n)]
    params = [SamplingParams(temperature=2.0, top_k=k) for k in ks]
    out = sample(logits.to(device), _batch(params, vocab, device), return_logprob=False)
    for i, t in enumerate(out.next_token_ids):
        assert (logits[i] > logits[i, t]).sum().item() < ks[i]


def _nucleus_size(probs_sorted: torch.Tensor, top_p: float) -> int:
    """Smallest prefix whose mass reaches top_p."""
    return int((probs_sorted.cumsum(0) < top_p).sum().item()) + 1


def test_top_p_never_leaves_the_nucleus(device):
    vocab = 64
    row = _logits(1, vocab, seed=9)[0]
    probs_sorted = torch.softmax(row.double(), -1).sort(descending=True).values
    cum = probs_sorted.cumsum(0)
    top_p = float(cum[5] + cum[6]) / 2  # halfway between two cumulative masses: nucleus is ranks 0..6
    assert _nucleus_size(probs_sorted, top_p) == 7
    draws = _draw_repeated(row, SamplingParams(top_p=top_p), 10_000, device, rng_seed=10)
    ranks = _ranks(row)
    assert {ranks[t] for t in draws} == set(range(7))


def test_per_row_top_p(device):
    vocab, n = 100, 2000
    logits = _logits(n, vocab, seed=11)
    gen = random.Random(12)
    top_ps, limits = [], []
    for i in range(n):
        probs_sorted = torch.softmax(logits[i].double(), -1).sort(descending=True).values
        cum = probs_sorted.cumsum(0)
        j = gen.randrange(0, 30)
        top_ps.append(float(cum[j] + cum[j + 1]) / 2)
        limits.append(j + 2)
    params = [SamplingParams(top_p=p) for p in top_ps]
    out = sample(logits.to(device), _batch(params, vocab, device), return_logprob=False)
    for i, t in enumerate(out.next_token_ids):
        assert (logits[i] > logits[i, t]).sum().item() < limits[i]


def test_min_p_never_keeps_unlikely_tokens(device):
    vocab, n = 100, 3000
    logits = _logits(n, vocab, seed=13)
    probs = torch.softmax(logits.double(), -1)
    ratios = probs / probs.max(-1, keepdim=True).values  # p / p_max, 1 at the top
    gen = random.Random(14)
    min_ps = []
    for i in range(n):
        r = ratios[i].sort(descending=True).values
        j = gen.randrange(0, 20)
        min_ps.append(float(r[j] + r[j + 1]) / 2)  # keeps ranks 0..j
    params = [SamplingParams(temperature=1.0, min_p=m) for m in min_ps]
    out = sample(logits.to(device), _batch(params, vocab, device), return_logprob=False)
    for i, t in enumerate(out.next_token_ids):
        assert ratios[i, t].item() >= min_ps[i]


def test_top_k_then_top_p_then_min_p(device):
    # top-p is measured on the top-k distribution renormalized; min-p on the probability ratio.
    vocab, n, temperature = 80, 3000, 0.7
    logits = _logits(n, vocab, seed=15)
    gen = random.Random(16)
    params, allowed = [], []
    for i in range(n):
        probs_sorted = torch.softmax(logits[i].double() / temperature, -1).sort(descending=True).values
        k = gen.randrange(3, 40)
        renorm = probs_sorted[:k] / probs_sorted[:k].sum()
        cum = renorm.cumsum(0)
        j = gen.randrange(0, k - 1)
        top_p = float(cum[j] + cum[j + 1]) / 2  # nucleus of the top-k distribution: ranks 0..j+1
        ratio = probs_sorted / probs_sorted[0]
        m = gen.randrange(0, vocab - 1)
        min_p = float(ratio[m] + ratio[m + 1]) / 2 if gen.random() < 0.5 else 0.0  # keeps ranks 0..m
        params.append(SamplingParams(temperature=temperature, top_k=k, top_p=top_p, min_p=min_p))
        allowed.append(min(k, j + 2, m + 1 if min_p > 0 else vocab))
    out = sample(logits.to(device), _batch(params, vocab, device), return_logprob=False)
    for i, t in enumerate(out.next_token_ids):
        assert (logits[i] > logits[i, t]).sum().item() < allowed[i]


# ---------------------------------------------------------------------------------------------------------------
# Seeds
# ---------------------------------------------------------------------------------------------------------------


def _run_seeded(logits_per_step, target_params, position, others, device, vocab):
    """Tokens the target request draws over the steps, placed at `position` among `others`."""
    tokens = []
    gen = torch.Generator().manual_seed(99)
    for step, row in enumerate(logits_per_step):
        params = list(others)
        params.insert(position, target_params)
        rows = torch.randn(len(params), vocab, generator=gen) * 3
        rows[position] = row
        outputs = [[(step * 7 + j) % vocab for j in range(step)] for _ in params]  # step = tokens generated
        prompts = [[(j * 13) % vocab for j in range(5 + b)] for b in range(len(params))]
        batch = SamplingBatch.build(
            params, prompts, outputs, vocab, device, rng=random.Random(step + position)
        )
        tokens.append(sample(rows.to(device), batch).next_token_ids[position])
    return tokens


@pytest.mark.parametrize(
    "target",
    [SamplingParams(seed=42), SamplingParams(seed=7, temperature=0.8, top_k=50, top_p=0.95, min_p=0.01)],
    ids=["plain", "filtered"],
)
def test_seeded_request_repeats_whatever_the_batch(device, target):
    vocab, num_steps = 300, 25
    logits_per_step = list(_logits(num_steps, vocab, seed=17, scale=1.0))
    alone = _run_seeded(logits_per_step, target, 0, [], device, vocab)
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=3, frequency_penalty=0.5, presence_penalty=-0.3),
        SamplingParams(seed=43, top_p=0.5, repetition_penalty=1.3),
        SamplingParams(min_p=0.2, temperature=2.0),
        SamplingParams(),
        SamplingParams(seed=42, temperature=1.5),  # same seed, other options: a different stream of draws
    ]
    for position, batch_others in [(3, others), (0, others[:2]), (6, others), (1, others[4:5])]:
        assert _run_seeded(logits_per_step, target, position, batch_others, device, vocab) == alone
    # The draws are not degenerate: many distinct tokens over the steps.
    assert len(set(alone)) > 10


def test_different_seeds_draw_differently(device):
    vocab, num_steps = 1000, 30
    logits = _logits(1, vocab, seed=18, scale=0.5)[0]  # flat-ish: draws spread out
    sequences = []
    for seed in range(8):
        seq = []
        for step in range(num_steps):
            batch = SamplingBatch.build([SamplingParams(seed=seed)], [[1]], [[0] * step], vocab, device)
            seq.append(sample(logits[None].to(device), batch).next_token_ids[0])
        sequences.append(tuple(seq))
    assert len(set(sequences)) == 8
    assert all(len(set(s)) > 20 for s in sequences)  # and the step changes the draw


def test_unseeded_draws_follow_the_rng():
    vocab = 500
    logits = _logits(16, vocab, seed=19, scale=0.5)
    params = [SamplingParams() for _ in range(16)]

    def run(rng_seed):
        return sample(logits, _batch(params, vocab, "cpu", rng_seed=rng_seed)).next_token_ids

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_empty_batch(device):
    out = sample(torch.empty(0, 10, device=device), _batch([], 10, device), top_logprobs_num=3)
    assert out.next_token_ids == [] and out.logprobs == [] and out.top_logprobs == []


# ---------------------------------------------------------------------------------------------------------------
# Penalties
# ---------------------------------------------------------------------------------------------------------------


def _reference_penalties(logits, prompts, outputs, params):
    """Hand-written penalty formulas, one element at a time in float64."""
    out = logits.double().clone()
    for b, p in enumerate(params):
        seen = set(prompts[b]) | set(outputs[b])
        counts = Counter(outputs[b])
        for v in range(logits.shape[1]):
            x = out[b, v].item()
            if v in seen:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            if counts[v]:
                x -= p.frequency_penalty * counts[v] + p.presence_penalty
            out[b, v] = x
    return out


def _random_requests(n, vocab, seed):
    gen = random.Random(seed)
    prompts = [[gen.randrange(vocab) for _ in range(gen.randrange(0, 30))] for _ in range(n)]
    outputs = [[gen.randrange(vocab) for _ in range(gen.randrange(0, 30))] for _ in range(n)]
    params = [
        SamplingParams(
            frequency_penalty=gen.uniform(-2, 2) if gen.random() < 0.7 else 0.0,
            presence_penalty=gen.uniform(-2, 2) if gen.random() < 0.7 else 0.0,
            repetition_penalty=gen.uniform(0.5, 2.0) if gen.random() < 0.7 else 1.0,
        )
        for _ in range(n)
    ]
    return prompts, outputs, params


def test_penalties_match_the_formulas(device):
    vocab, n = 40, 12
    prompts, outputs, params = _random_requests(n, vocab, seed=20)
    logits = _logits(n, vocab, seed=21)
    batch = _batch(params, vocab, device, prompts=prompts, outputs=outputs)
    got = apply_penalties(
        logits.to(device),
        output_counts=batch.output_counts,
        frequency_penalties=batch.frequency_penalties,
        presence_penalties=batch.presence_penalties,
        seen_mask=batch.seen_mask,
        repetition_penalties=batch.repetition_penalties,
    )
    want = _reference_penalties(logits, prompts, outputs, params)
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-6, atol=1e-5)
    assert not torch.equal(got.cpu(), logits)  # something was penalized


def test_token_counts_and_mask(device):
    vocab = 30
    prompts, outputs, _ = _random_requests(7, vocab, seed=22)
    counts = build_token_counts(outputs, vocab, device).cpu()
    mask = build_token_mask(prompts, outputs, vocab_size=vocab, device=device).cpu()
    for b in range(7):
        c = Counter(outputs[b])
        assert counts[b].tolist() == [c[v] for v in range(vocab)]
        seen = set(prompts[b]) | set(outputs[b])
        assert mask[b].tolist() == [v in seen for v in range(vocab)]


def test_rows_without_penalties_are_untouched(device):
    vocab, n = 50, 6
    prompts, outputs, params = _random_requests(n, vocab, seed=23)
    params[2] = SamplingParams()
    logits = _logits(n, vocab, seed=24).to(device)
    batch = _batch(params, vocab, device, prompts=prompts, outputs=outputs)
    got = apply_penalties(
        logits,
        output_counts=batch.output_counts,
        frequency_penalties=batch.frequency_penalties,
        presence_penalties=batch.presence_penalties,
        seen_mask=batch.seen_mask,
        repetition_penalties=batch.repetition_penalties,
    )
    assert torch.equal(got[2], logits[2])


def test_greedy_takes_the_argmax_of_penalized_logits(device):
    vocab = 20
    logits = torch.linspace(-1, 1, vocab)[None].clone()  # token 19 is the argmax
    params = [SamplingParams(temperature=0, presence_penalty=2.0)]
    out = sample(logits.to(device), _batch(params, vocab, device, outputs=[[19, 18]]))
    assert out.next_token_ids == [17]
    # and the reported logprob is still the raw one
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits, -1)[0, 17].item(), abs=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Log-probabilities
# ---------------------------------------------------------------------------------------------------------------


def test_logprobs_are_raw_and_top_n_sorted(device):
    vocab, n = 100, 8
    prompts, outputs, params = _random_requests(n, vocab, seed=25)
    for i, p in enumerate(params):
        p.temperature, p.top_k, p.seed = [0.0, 0.5, 1.0, 2.0][i % 4], [-1, 5][i % 2], i
    nums = [0, 1, 5, 3, 0, 100, 2, 7]
    logits = _logits(n, vocab, seed=26)
    out = sample(logits.to(device), _batch(params, vocab, device, prompts, outputs), top_logprobs_num=nums)
    raw = torch.log_softmax(logits.double(), -1)
    for b in range(n):
        t = out.next_token_ids[b]
        assert out.logprobs[b] == pytest.approx(raw[b, t].item(), abs=1e-5)
        top = out.top_logprobs[b]
        assert len(top) == nums[b]
        want = torch.topk(raw[b], nums[b])
        assert [tok for tok, _ in top] == want.indices.tolist()
        assert [lp for _, lp in top] == pytest.approx(want.values.tolist(), abs=1e-5)
        assert all(top[i][1] >= top[i + 1][1] for i in range(len(top) - 1))


def test_top_logprobs_int_for_all_and_no_logprob(device):
    vocab = 50
    logits = _logits(3, vocab, seed=27).to(device)
    out = sample(
        logits, _batch([SamplingParams()] * 3, vocab, device), top_logprobs_num=2, return_logprob=False
    )
    assert out.logprobs is None
    assert [len(t) for t in out.top_logprobs] == [2, 2, 2]
    assert out.next_token_ids_device.tolist() == out.next_token_ids
    assert all(math.isfinite(lp) for t in out.top_logprobs for _, lp in t)
