"""A chat choice's output as DeepSeek's users read it: the thinking apart as `reasoning_content`
(--reasoning-parser) and tool calls as OpenAI's `tool_calls` (--tool-call-parser), whole or as stream deltas.

The text flows one way: the reasoning parser splits off the thinking, the tool-call parser reads the calls out of
what remains; each holds back a marker cut between two deltas until the next one (or the end) tells.
"""

from __future__ import annotations

from typing import Any

from moeserve.args import ServerArgs
from moeserve.server.http.protocol import ChatCompletionRequest
from moeserve.text.parsers.reasoning import ReasoningParser
from moeserve.text.parsers.tool_calls import ToolCallParser, merge_deltas


def offered_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools the model is shown and may call (none with tool_choice "none"; only the named one when named)."""
    if not req.tools or req.tool_choice == "none":
        return None
    if isinstance(req.tool_choice, dict):
        name = req.tool_choice["function"]["name"]
        return [t for t in req.tools if t["function"]["name"] == name]
    return req.tools


class ChatOutput:
    """One choice's text -> message fields (reasoning_content, content, tool_calls)."""

    def __init__(self, args: ServerArgs, req: ChatCompletionRequest):
        self.reasoning = (ReasoningParser(args.reasoning_parser, req.chat_template_kwargs)
                          if args.reasoning_parser and req.separate_reasoning else None)
        self.stream_reasoning = req.stream_reasoning
        tools = offered_tools(req)
        self.tools = (ToolCallParser(args.tool_call_parser, {t["function"]["name"] for t in tools})
                      if tools and args.tool_call_parser else None)
        self.held_reasoning = ""  # stream_reasoning false: the thinking goes out whole, with the last delta
        self.called = False

    def feed(self, text: str) -> dict[str, Any]:
        """The delta fields of this text delta (empty ones left out)."""
        return self._shape(*self._split(text, last=False), last=False)

    def finish(self) -> dict[str, Any]:
        """The delta fields of what was held back, once the output has ended."""
        return self._shape(*self._split("", last=True), last=True)

    def message(self, text: str) -> dict[str, Any]:
        """A whole output as an assistant message."""
        reasoning, content, calls = self._split(text, last=False)
        more = self._split("", last=True)
        msg: dict[str, Any] = {"role": "assistant", "content": content + more[1]}
        if self.reasoning is not None:
            msg["reasoning_content"] = (reasoning + more[0]) or None
        if self.tools is not None:
            calls = merge_deltas(calls + more[2])
            msg["tool_calls"] = calls or None
            msg["content"] = msg["content"] or (None if calls else "")
        return msg

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" for an output that ended by calling tools."""
        return "tool_calls" if reason == "stop" and self.called else reason

    def _split(self, text: str, last: bool) -> tuple[str, str, list[dict[str, Any]]]:
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if last:
                r, c = self.reasoning.finish()
                reasoning, content = reasoning + r, content + c
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if last:
                c, more = self.tools.finish()
                content, calls = content + c, calls + more
            self.called = self.called or bool(calls)
        return reasoning, content, calls

    def _shape(self, reasoning: str, content: str, calls: list[dict[str, Any]], last: bool) -> dict[str, Any]:
        if not self.stream_reasoning:
            self.held_reasoning += reasoning
            reasoning = self.held_reasoning if last else ""
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta


def merge_fields(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two deltas' fields as one (texts joined, tool-call deltas in order)."""
    out = dict(a)
    for key, value in b.items():
        out[key] = out[key] + value if key in out else value
    return out
