"""Structured outputs on the rank (moeserve/constrained/, the sampler's token mask, step results' matchers).

Random JSON schemas and regexes, drawn per seed, constrain the embedded default model's tokenizer over random
weights (load_format dummy: the model would rather write anything) and over the trained weights. The independent
references are `jsonschema` and Python's `re.fullmatch`: every constrained output validates or matches, the same
requests without the grammar do not. Free requests batched beside constrained ones keep the tokens they get alone,
with overlap scheduling on and off.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from moeserve.constrained.base import GrammarError
from moeserve.constrained.registry import make_grammar_backend
from moeserve.models.default_model import default_model_path
from moeserve.rank.sampling_params import SamplingParams
from moeserve.text.tokenizer import load_tokenizer
from tests.grammar_specs import random_regex, random_schema
from tests.rank.inprocess import InProcessEngine

PROMPTS = ["Give me JSON:", "The answer is", "def f(x):", "Once upon a time", "1, 2, 3,", "Hello"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def engines(tokenizer):
    """name -> engine: random weights and trained weights, with overlap scheduling."""
    return {fmt: InProcessEngine(tokenizer, model_path=default_model_path(), dtype="float32", max_total_tokens=16384,
                                 load_format=fmt) for fmt in ("dummy", "auto")}


def _params(rng: random.Random, **grammar) -> SamplingParams:
    temperature = rng.choice([0.0, 0.7, 1.0, 1.5])
    return SamplingParams(max_new_tokens=256, temperature=temperature, seed=rng.randrange(1 << 30), **grammar)


def _text(tokenizer, out: dict) -> str:
    return tokenizer.decode(out["output_ids"], skip_special_tokens=True)


def _validates(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.mark.parametrize("weights", ["dummy", "auto"])
@pytest.mark.parametrize("seed", range(3))
def test_json_schema_outputs_validate(engines, tokenizer, weights, seed):
    rng = random.Random(seed)
    schemas = [random_schema(rng) for _ in PROMPTS]
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = [_params(rng, json_schema=json.dumps(s)) for s in schemas]
    outs = engines[weights].run(prompts, params)
    for out, schema in zip(outs, schemas, strict=True):
        text = _text(tokenizer, out)
        assert out["finish_reason"].type == "stop", (text, schema)
        jsonschema.validate(json.loads(text), schema)
    free = engines[weights].run(prompts, [SamplingParams(max_new_tokens=64, temperature=p.temperature, seed=p.seed)
                                          for p in params])
    assert not any(_validates(_text(tokenizer, o), s) for o, s in zip(free, schemas, strict=True))


@pytest.mark.parametrize("weights", ["dummy", "auto"])
@pytest.mark.parametrize("seed", range(3))
def test_regex_outputs_match(engines, tokenizer, weights, seed):
    rng = random.Random(100 + seed)
    regexes = [random_regex(rng) for _ in PROMPTS]
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = [_params(rng, regex=r) for r in regexes]
    outs = engines[weights].run(prompts, params)
    for out, regex in zip(outs, regexes, strict=True):
        assert out["finish_reason"].type == "stop"
        assert re.fullmatch(regex, _text(tokenizer, out)), (regex, _text(tokenizer, out))
    free = engines[weights].run(prompts, [SamplingParams(max_new_tokens=32, temperature=p.temperature, seed=p.seed)
                                          for p in params])
    assert sum(bool(re.fullmatch(r, _text(tokenizer, o))) for o, r in zip(free, regexes, strict=True)) <= 1


def test_ebnf_and_ignore_eos(engines, tokenizer):
    """An EBNF grammar (xgrammar's dialect); with ignore_eos the grammar's end still ends the request."""
    grammar = 'root ::= ("yes" | "no") " " [0-9] [0-9]?'
    rng = random.Random(7)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = [SamplingParams(max_new_tokens=64, temperature=1.0, seed=rng.randrange(1000), ebnf=grammar,
                             ignore_eos=i % 2 == 1) for i in range(len(PROMPTS))]
    for out in engines["dummy"].run(prompts, params):
        assert out["finish_reason"].type == "stop"
        assert re.fullmatch(r"(yes|no) [0-9][0-9]?", _text(tokenizer, out))


@pytest.mark.parametrize("overlap,mixed_chunk", [(True, False), (False, False), (True, True)])
def test_free_requests_keep_their_tokens_beside_constrained_ones(tokenizer, overlap, mixed_chunk):
    kw = dict(model_path=default_model_path(), dtype="float32", max_total_tokens=8192,
              disable_overlap_schedule=not overlap)
    if mixed_chunk:  # prompts admitted a few at a time, prefilled beside the running decodes
        kw.update(enable_mixed_chunk=True, chunked_prefill_size=8, max_prefill_tokens=8)
    alone, mixed = InProcessEngine(tokenizer, **kw), InProcessEngine(tokenizer, **kw)
    rng = random.Random(3)
    free_prompts = [tokenizer.encode(p) for p in PROMPTS]
    # greedy, and seeded draws (a seeded row's tokens depend on its own logits only: sampler.py)
    free = [SamplingParams(max_new_tokens=rng.choice([5, 20, 40]), ignore_eos=i % 2 == 0,
                           **({"temperature": 0.0} if i % 3 else {"temperature": 0.9, "seed": i}))
            for i in range(len(PROMPTS))]
    want = alone.run(free_prompts, free)
    constrained = [_params(rng, json_schema=json.dumps(random_schema(rng))) if i % 2 else
                   _params(rng, regex=random_regex(rng)) for i in range(len(PROMPTS))]
    prompts, params = [], []
    for i in range(len(PROMPTS)):  # interleaved: constrained rows between free ones
        prompts += [free_prompts[i], free_prompts[-1 - i]]
        params += [free[i], constrained[i]]
    got = mixed.run(prompts, params)
    assert [g["output_ids"] for g in got[0::2]] == [w["output_ids"] for w in want]
    assert all(g["finish_reason"].type == "stop" for g in got[1::2])
    if overlap:
        assert alone.steps.num_overlapped > 0
    if mixed_chunk:
        assert mixed.scheduler.stats.mixed_steps > 0


def test_mask_covers_the_padded_vocabulary(tokenizer):
    """Logits wider than the tokenizer's vocabulary (padding): the padding is never allowed to a constrained row,
    and a free row of the same step is untouched."""
    padded = tokenizer.vocab_size + 45
    backend = make_grammar_backend("xgrammar", tokenizer, padded)
    matcher = backend.matcher(backend.compile("regex", "[a-z]{1,8}"))
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        logits = torch.randn(3, padded, generator=gen)
        logits[1, tokenizer.vocab_size:] = 100.0  # the padding would win
        mask = backend.token_mask([None, matcher, None], torch.device("cpu"))
        masked = mask.apply(logits)
        assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
        assert bool((masked[1, tokenizer.vocab_size:] == float("-inf")).all())
        token = int(masked[1].argmax())
        assert re.fullmatch("[a-z]+", tokenizer.decode([token])) or token in tokenizer.eos_token_ids
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            break


@pytest.mark.parametrize("kind,spec,words", [
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", '{"type": 5}', "invalid json_schema"),
    ("regex", "(ab", "invalid regex"),
    ("ebnf", "root ::= ", "invalid ebnf"),
])
def test_bad_specs_are_grammar_errors(tokenizer, kind, spec, words):
    backend = make_grammar_backend("xgrammar", tokenizer, tokenizer.vocab_size)
    with pytest.raises(GrammarError, match=words):
        backend.compile(kind, spec)
    assert backend.compile("regex", "a|b") is backend.compile("regex", "a|b")  # compiled once
    with pytest.raises(GrammarError, match="--grammar-backend none"):
        make_grammar_backend("none", tokenizer, tokenizer.vocab_size).compile(kind, spec)


def test_the_rank_refuses_what_it_cannot_compile(engines, tokenizer):
    out = engines["dummy"].run([tokenizer.encode("x")], SamplingParams(regex="(ab"))[0]
    assert out["finish_reason"].type == "abort" and out["finish_reason"].status_code == 400
    assert "invalid regex" in out["finish_reason"].message
    stuck = engines["dummy"].run([tokenizer.encode("x")], SamplingParams(ebnf="root ::= root"))[0]["finish_reason"]
    assert stuck.status_code == 400 and "allows no token" in stuck.message
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams(regex="a", ebnf='root ::= "a"').validate()


def test_a_retracted_request_keeps_its_grammar(tokenizer):
    """A KV pool too small for the batch: requests are retracted and recomputed from prompt + output, their matchers
    kept; the outputs are those of a pool that holds them all, and validate."""
    kw = dict(model_path=default_model_path(), dtype="float32", page_size=4, load_format="dummy")
    small, large = (InProcessEngine(tokenizer, max_total_tokens=n, **kw) for n in (192, 8192))
    schema = {"type": "array", "minItems": 2, "maxItems": 3, "items": {
        "type": "object", "required": ["id", "name"], "additionalProperties": False,
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "name": {"enum": ["ab", "cd"]}}}}
    rng = random.Random(9)
    prompts = [[rng.randrange(5, 1000) for _ in range(rng.randrange(8, 16))] for _ in range(8)]
    params = [SamplingParams(max_new_tokens=96, temperature=1.0, seed=i, json_schema=json.dumps(schema))
              for i in range(len(prompts))]
    got, want = small.run(prompts, params), large.run(prompts, params)
    assert small.scheduler.stats.retractions > 0 and large.scheduler.stats.retractions == 0
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    for out in got:
        assert out["finish_reason"].type == "stop"
        jsonschema.validate(json.loads(_text(tokenizer, out)), schema)
