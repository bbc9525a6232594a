"""Reasoning and tool-call parsers (moeserve/text/parsers): a whole output and the same output streamed in random
pieces give the same fields; DeepSeek's formats; the grammar of a forced tool call accepts a call and nothing else."""

from __future__ import annotations

import json
import random

import pytest

from moeserve.text.parsers.reasoning import REASONING_PARSERS, ReasoningParser, split_reasoning
from moeserve.text.parsers.tool_calls import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    TOOL_CALL_PARSERS,
    ToolCallParser,
    merge_deltas,
    parse_tool_calls,
    tool_call_ebnf,
)


def _pieces(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _v3_call(name: str, args: dict) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{json.dumps(args)}\n```{CALL_END}"


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(["alpha", "beta", "<", "think", "x>", "{", "}", "\n", "ok."]) for _ in range(n))


@pytest.mark.parametrize("seed", range(5))
def test_reasoning_streamed_equals_whole(seed):
    rng = random.Random(seed)
    thinking, answer = _words(rng, 12), _words(rng, 8).strip() or "done"
    cases = [("deepseek-r1", None, f"<think>\n{thinking}</think>\n\n{answer}", (f"\n{thinking}", answer)),
             ("deepseek-r1", None, f"{thinking}</think>{answer}", (thinking, answer)),
             ("deepseek-r1", None, thinking, (thinking, "")),  # cut short inside the thinking
             ("deepseek-v3", {"thinking": True}, f"{thinking}</think>{answer}", (thinking, answer)),
             ("deepseek-v3", None, f"{answer} </think> x", (None, f"{answer} </think> x")),
             ("qwen3", None, f"<think>{thinking}</think>{answer}", (thinking, answer))]
    for name, kwargs, text, want in cases:
        assert split_reasoning(name, text, kwargs) == (want[0] or None, want[1]), (name, text)
        for _ in range(20):
            parser = ReasoningParser(name, kwargs)
            parts = [parser.feed(p) for p in _pieces(rng, text)] + [parser.finish()]
            assert ("".join(r for r, _ in parts) or None, "".join(c for _, c in parts)) == (want[0] or None,
                                                                                         want[1])
    assert set(REASONING_PARSERS) >= {"deepseek-r1", "deepseek-v3"}


@pytest.mark.parametrize("seed", range(5))
def test_tool_calls_streamed_equal_whole(seed):
    rng = random.Random(seed)
    a1 = {"city": _words(rng, 3), "days": rng.randint(1, 9)}
    a2 = {"a": rng.random(), "b": [rng.randint(0, 9) for _ in range(3)], "s": "```json}"}
    lead = _words(rng, 5)
    v3 = lead + CALLS_BEGIN + _v3_call("get_weather", a1) + _v3_call("unknown_fn", {}) + _v3_call("add", a2) + CALLS_END
    v31 = CALLS_BEGIN + f"{CALL_BEGIN}add{SEP}{json.dumps(a2)}{CALL_END}" + CALLS_END
    names = {"get_weather", "add"}
    for name, text, want in [("deepseekv3", v3, (lead, [("get_weather", a1), ("add", a2)])),
                             ("deepseekv31", v31, ("", [("add", a2)])),
                             ("deepseekv3", lead + "<｜tool", (lead + "<｜tool", []))]:
        content, calls = parse_tool_calls(name, text, names)
        assert content == want[0]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == want[1]
        assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
        for _ in range(30):
            parser = ToolCallParser(name, names)
            outs = [parser.feed(p) for p in _pieces(rng, text)] + [parser.finish()]
            deltas = [d for _, ds in outs for d in ds]
            assert "".join(c for c, _ in outs) == content
            streamed = merge_deltas(deltas)
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == \
                [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
            firsts = [d for d in deltas if "id" in d]  # each call's first delta: id, type and name, no arguments
            assert [d["index"] for d in firsts] == list(range(len(calls)))
            assert all(d["function"]["arguments"] == "" for d in firsts)
    assert set(TOOL_CALL_PARSERS) == {"deepseekv3", "deepseekv31"}


def test_a_call_cut_short_keeps_its_arguments():
    text = CALLS_BEGIN + f"{CALL_BEGIN}function{SEP}add\n```json\n" + '{"a": 1'
    assert [c["function"]["arguments"] for c in parse_tool_calls("deepseekv3", text, {"add"})[1]] == ['{"a": 1']


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
def test_forced_call_grammar_accepts_a_call_and_nothing_else(name):
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string as accepts

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
             {"type": "function", "function": {"name": "add", "parameters": {
                 "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
    grammar = Grammar.from_ebnf(tool_call_ebnf(name, tools))
    fmt = TOOL_CALL_PARSERS[name]

    def block(fn: str, args: str) -> str:
        return f"{CALLS_BEGIN}{CALL_BEGIN}{fmt.header(fn)}{args}{fmt.args_end()}{CALL_END}{CALLS_END}"

    good = block("add", '{"a": 3}')
    assert accepts(grammar, good) and accepts(grammar, block("get_weather", '{"city": "Paris"}'))
    assert parse_tool_calls(name, good, {"add"})[1][0]["function"]["arguments"] == '{"a": 3}'
    for bad in (block("add", '{"a": "three"}'), block("sub", '{"a": 3}'), block("add", '{}'), "plain text",
                good + "more"):
        assert not accepts(grammar, bad), bad
