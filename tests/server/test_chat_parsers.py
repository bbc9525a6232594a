"""Chat as DeepSeek's users call it, over a FakeClient whose outputs are scripted texts (the tiny model does not
choose to think or to call tools): --reasoning-parser and --tool-call-parser with the official openai client,
whole and streamed, and tool calls round-tripped through the default model's chat template."""

from __future__ import annotations

import json
import random

import openai
import pytest
from server_fakes import FakeClient, serve_in_thread

from moeserve.server.http.app import build_app
from moeserve.text.parsers.tool_calls import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    parse_tool_calls,
)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
             "a": {"type": "number"}, "b": {"type": "number"}}}}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def fake(default_tokenizer):
    return FakeClient(default_tokenizer, context_length=1024, reasoning_parser="deepseek-r1",
                      tool_call_parser="deepseekv3")


@pytest.fixture(scope="module")
def oai(fake):
    with serve_in_thread(build_app(fake)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


THINK = "<think>A tool knows that.</think>"  # R1 thinks before it answers or calls (--reasoning-parser deepseek-r1)


def _script(fake, text: str) -> None:
    fake.script = fake.tokenizer.encode(text, add_special_tokens=False)


def _call(name: str, args: dict) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{json.dumps(args)}\n```{CALL_END}"


def _stream(oai, **kw):
    """(reasoning, content, tool calls merged from their deltas, finish reason) of a streamed chat."""
    reasoning, content, calls, reason = "", "", {}, None
    for chunk in oai.chat.completions.create(model="fake-model", stream=True, **kw):
        for choice in chunk.choices:
            d = choice.delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
            for tc in d.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.function.name, "a call's first delta names it"
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += tc.function.arguments or ""
            reason = choice.finish_reason or reason
    return reasoning, content, [tuple(calls[i]) for i in sorted(calls)], reason


def test_reasoning_apart_whole_and_streamed(oai, fake):
    rng = random.Random(7)
    thinking = " ".join(rng.choice(["so", "the", "sum", "is", "4,", "check:", "2+2"]) for _ in range(12))
    _script(fake, f"<think>{thinking}</think>\n\nThe answer is 4.")
    msg = oai.chat.completions.create(model="fake-model", messages=USER, max_tokens=200).choices[0].message
    assert (msg.reasoning_content, msg.content) == (thinking, "The answer is 4.")
    assert _stream(oai, messages=USER, max_tokens=200)[:2] == (thinking, "The answer is 4.")
    whole = oai.chat.completions.create(model="fake-model", messages=USER, max_tokens=200,
                                        extra_body={"separate_reasoning": False}).choices[0].message
    assert whole.content == f"<think>{thinking}</think>\n\nThe answer is 4."
    held = _stream(oai, messages=USER, max_tokens=200, extra_body={"stream_reasoning": False})
    assert held[:2] == (thinking, "The answer is 4.")


def test_tool_calls_whole_streamed_and_round_tripped(oai, fake):
    args = {"city": "Paris", "days": random.Random(3).randint(1, 9)}
    _script(fake, THINK + "Let me look." + CALLS_BEGIN + _call("get_weather", args) + _call("add", {"a": 1, "b": 2})
            + CALLS_END)
    resp = oai.chat.completions.create(model="fake-model", messages=USER, tools=TOOLS, max_tokens=300)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    assert choice.message.reasoning_content == "A tool knows that."
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", args), ("add", {"a": 1, "b": 2})]
    reasoning, content, streamed, reason = _stream(oai, messages=USER, tools=TOOLS, max_tokens=300)
    assert (reasoning, content, reason) == ("A tool knows that.", "Let me look.", "tool_calls")
    assert [(n, json.loads(a)) for n, a in streamed] == calls

    # the assistant's calls and the tool's answer go back through the chat template, which writes the calls the
    # way the model does: parsing the rendered prompt finds the same calls
    history = USER + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "sunny, 21 C"},
                      {"role": "tool", "tool_call_id": choice.message.tool_calls[1].id, "content": "3"}]
    _script(fake, THINK + "It is sunny.")
    again = oai.chat.completions.create(model="fake-model", messages=history, tools=TOOLS, max_tokens=50)
    assert again.choices[0].message.content == "It is sunny." and again.choices[0].finish_reason == "stop"
    prompt = fake.tokenizer.decode(fake.requests[-1].input_ids, skip_special_tokens=False)
    assert "### get_weather" in prompt and "sunny, 21 C" in prompt and "<｜tool▁outputs▁begin｜>" in prompt
    start = prompt.index(CALLS_BEGIN, prompt.index("<｜Assistant｜>"))  # the system prompt names the markers too
    rendered = prompt[start:prompt.index(CALLS_END, start) + len(CALLS_END)]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in parse_tool_calls("deepseekv3", rendered)[1]] == calls


def test_tool_choice_none_and_unknown_functions(oai, fake):
    text = CALLS_BEGIN + _call("get_weather", {"city": "Oslo"}) + CALLS_END
    _script(fake, THINK + text)
    msg = oai.chat.completions.create(model="fake-model", messages=USER, tools=TOOLS, tool_choice="none",
                                      max_tokens=200).choices[0].message
    assert msg.content == text and not msg.tool_calls  # no tools offered: nothing parsed
    _script(fake, THINK + CALLS_BEGIN + _call("delete_everything", {}) + _call("add", {"a": 2}) + CALLS_END)
    msg = oai.chat.completions.create(model="fake-model", messages=USER, tools=TOOLS, max_tokens=200).choices[0].message
    assert [c.function.name for c in msg.tool_calls] == ["add"]  # a function not offered is dropped


@pytest.mark.parametrize("kw,words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0]"),
    ({"tools": TOOLS, "tool_choice": "required"}, "grammar backend"),  # the FakeClient has none
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]}, "role 'tool'"),
])
def test_bad_tool_requests_are_400s(oai, fake, kw, words):
    _script(fake, THINK + "fine")
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="fake-model", **({"messages": USER} | kw), max_tokens=5)
    assert words in str(e.value)
    assert oai.chat.completions.create(model="fake-model", messages=USER, max_tokens=40).choices[0].message.content \
        == "fine"  # the server goes on serving
