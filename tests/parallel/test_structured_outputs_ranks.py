"""Structured outputs on several ranks (CPU, gloo): an attention TP group (every rank masks its rows, the leader's
tokens are shared and every rank's matcher takes them) and DP attention (each group its own requests). Random regexes
and JSON schemas on the embedded default model; references: re.fullmatch and jsonschema; free greedy requests in the
same batch equal the single-rank run."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from moeserve.models.default_model import default_model_path
from moeserve.rank.sampling_params import SamplingParams
from moeserve.text.tokenizer import load_tokenizer
from tests.grammar_specs import random_regex, random_schema
from tests.rank.inprocess import InProcessEngine

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("layout", [dict(tp_size=2), dict(tp_size=2, enable_dp_attention=True, dp_size=2)],
                         ids=["attn_tp2", "dp2"])
def test_constrained_and_free_requests_on_several_ranks(layout):
    from moeserve.server.engine import Engine

    tokenizer = load_tokenizer(default_model_path())
    rng = random.Random(21)
    texts = ["Write:", "The capital of France is", "JSON:", "Once upon a time", "1, 2, 3,", "Hello"]
    specs = [("regex", random_regex(rng)) if i % 2 else ("json_schema", json.dumps(random_schema(rng)))
             for i in range(3)]
    free = dict(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    params = []
    for i in range(len(texts)):
        if i % 2:
            params.append(free)
        else:
            kind, spec = specs[i // 2]
            params.append({kind: spec, "max_new_tokens": 256, "temperature": 1.0, "seed": i})
    want = InProcessEngine(tokenizer, model_path=default_model_path(), dtype="float32").run(
        [tokenizer.encode(t) for t in texts[1::2]], SamplingParams(**free))
    eng = Engine(model_path=default_model_path(), dtype="float32", log_level="warning", **layout)
    try:
        outs = eng.generate(texts, params)
    finally:
        eng.shutdown()
    assert [o["output_ids"] for o in outs[1::2]] == [w["output_ids"] for w in want]
    for out, (kind, spec) in zip(outs[0::2], specs, strict=True):
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        if kind == "regex":
            assert re.fullmatch(spec, out["text"]), (spec, out["text"])
        else:
            jsonschema.validate(json.loads(out["text"]), json.loads(spec))
