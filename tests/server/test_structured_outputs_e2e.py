"""Structured outputs end to end: a real server on the embedded default model (conftest.py's `server`), the official
openai client's response_format, /generate's json_schema / regex / ebnf, and 400s for bad specs that leave the
server serving. References: jsonschema and re.fullmatch."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import openai
import pytest

from tests.grammar_specs import random_regex, random_schema

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"], "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3}}}


def test_openai_response_format_json_schema(oai):
    messages = [{"role": "user", "content": "Describe a person."}]
    for seed in range(3):
        out = oai.chat.completions.create(
            model="tiny", messages=messages, max_tokens=128, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    free = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=64, temperature=0)
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(free.choices[0].message.content), PERSON)
    obj = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=128, temperature=0.8, seed=1,
                                      response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":  # any object: it may run past max_tokens
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].message.content.startswith("{")


def test_openai_streamed_json_schema_and_regex_extra(oai):
    schema = random_schema(random.Random(5))
    stream = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "JSON please"}], max_tokens=256, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)
    out = oai.completions.create(model="tiny", prompt="Phone:", max_tokens=32, extra_body={"regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", out.choices[0].text)


def test_generate_regex_json_schema_ebnf(http):
    rng = random.Random(11)
    for _ in range(4):
        regex = random_regex(rng)
        r = http.post("/generate", json={"text": "Write:", "sampling_params": {
            "regex": regex, "max_new_tokens": 64, "temperature": 1.0, "seed": rng.randrange(1000)}})
        assert r.status_code == 200, r.text
        assert re.fullmatch(regex, r.json()["text"]), (regex, r.json()["text"])
    schema = random_schema(rng)
    batch = http.post("/generate", json={"text": ["A", "B", "C"], "sampling_params": [
        {"json_schema": json.dumps(schema), "max_new_tokens": 256}, {"max_new_tokens": 8, "temperature": 0},
        {"ebnf": 'root ::= "yes" | "no"', "max_new_tokens": 8}]})
    assert batch.status_code == 200, batch.text
    outs = batch.json()
    jsonschema.validate(json.loads(outs[0]["text"]), schema)
    assert outs[2]["text"] in ("yes", "no") and outs[2]["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("params,param,words", [
    ({"json_schema": '{"type": "object", "properties": 5}'}, "json_schema", "invalid json_schema"),
    ({"json_schema": "{oops"}, "json_schema", "not valid JSON"),
    ({"regex": "[a-"}, "regex", "invalid regex"),
    ({"ebnf": "root ::= undefined_rule"}, "ebnf", "invalid ebnf"),
    ({"regex": "a", "json_schema": "{}"}, None, "at most one"),
])
def test_bad_specs_are_400s_and_the_server_keeps_serving(http, oai, params, param, words):
    r = http.post("/generate", json={"text": "x", "sampling_params": {**params, "max_new_tokens": 4}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["param"] == param, err
    ok = http.post("/generate", json={"text": "still serving", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] >= 1


def test_bad_response_format_is_a_400(oai):
    messages = [{"role": "user", "content": "x"}]
    for fmt, words in [({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}, "json_schema"),
                       ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema"),
                       ({"type": "structural_tag"}, "not supported")]:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model="tiny", messages=messages, max_tokens=4, response_format=fmt)
        assert words in str(e.value) and "response_format" in str(e.value)
    assert oai.chat.completions.create(model="tiny", messages=messages, max_tokens=2).usage.completion_tokens >= 1


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "days"], "properties": {
        "city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["a"], "properties": {"a": {"type": "integer"}}}}}


def test_tool_choice_required_and_named_are_enforced(oai):
    """The tiny model never writes DeepSeek's tool-call markers by itself; with tool_choice required (or a named
    function) the grammar makes it call, with arguments that validate, parsed back into tool_calls."""
    messages = [{"role": "user", "content": "What will the weather be?"}]
    free = oai.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, ADD], max_tokens=48,
                                       temperature=0)
    assert not free.choices[0].message.tool_calls and free.choices[0].finish_reason != "tool_calls"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
    for seed, choice in enumerate(["required", "required", {"type": "function", "function": {"name": "add"}}]):
        out = oai.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, ADD], tool_choice=choice,
                                          max_tokens=512, temperature=1.0, seed=seed)
        c = out.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
        call = c.message.tool_calls[0].function
        if isinstance(choice, dict):
            assert call.name == "add"
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_reasoning_apart_on_the_default_model(oai):
    """A regex makes the tiny model think (V3.1-style, chat_template_kwargs thinking) and then answer: the thinking
    comes back as reasoning_content, whole and streamed, the answer as content."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Think, then answer."}], max_tokens=96,
              temperature=1.0, seed=5, extra_body={"regex": "[a-z ]{4,24}</think>[A-Z][a-z ]{2,24}",
                                                   "chat_template_kwargs": {"thinking": True}})
    msg = oai.chat.completions.create(**kw).choices[0].message
    assert re.fullmatch("[a-z ]{4,24}", msg.reasoning_content) and re.fullmatch("[A-Z][a-z ]{2,24}", msg.content)
    reasoning = content = ""
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert (reasoning, content) == (msg.reasoning_content, msg.content)  # the same seed: the same text
    plain = oai.chat.completions.create(**(kw | {"extra_body": {"regex": kw["extra_body"]["regex"]}}))
    assert "</think>" in plain.choices[0].message.content  # no thinking asked: all of it is content
