"""Reasoning parsers (--reasoning-parser, SGLang's names): the model's thinking apart from its answer.

DeepSeek-R1 thinks inside `<think> ... </think>` before it answers; its chat template already opens `<think>` in
the prompt, so the output starts inside the thinking and everything before `</think>` is reasoning, with or without
a `<think>` of its own. DeepSeek-V3.1 thinks only when the request's `chat_template_kwargs` says `thinking: true`
(its template then opens `<think>`); Qwen3 writes `<think>` itself. The parser is fed the output's text deltas as
they stream and returns each delta split into (reasoning, content); a tag cut between two deltas is held back
until the next one tells.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.text.parsers.markers import held_back

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    """How one model family marks its thinking."""

    starts_in_reasoning: bool  # the template opened the thinking (R1); else it needs `<think>` or a request switch
    thinking_kwarg: str | None = None  # chat_template_kwargs switch that opens the thinking (V3.1: "thinking")


REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "deepseek-r1": ReasoningFormat(starts_in_reasoning=True),
    "deepseek-v3": ReasoningFormat(starts_in_reasoning=False, thinking_kwarg="thinking"),
    "qwen3": ReasoningFormat(starts_in_reasoning=False, thinking_kwarg="enable_thinking"),
}



class ReasoningParser:
    """Splits one output's text into reasoning and content, delta by delta."""

    def __init__(self, name: str, template_kwargs: dict | None = None):
        fmt = REASONING_PARSERS[name]
        kwarg = (template_kwargs or {}).get(fmt.thinking_kwarg) if fmt.thinking_kwarg else None
        self.in_reasoning = fmt.starts_in_reasoning or bool(kwarg)
        self.at_start = True  # nothing emitted yet: a leading `<think>` opens (or repeats the opening of) the thinking
        self.after_end = False  # `</think>` seen and no content since
        self.buf = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) of this delta, less what may be a cut tag."""
        self.buf += delta
        reasoning = content = ""
        if self.at_start:
            stripped = self.buf.lstrip()
            if THINK_START.startswith(stripped):  # maybe `<think>`: wait for more (or for finish)
                return "", ""
            self.at_start = False
            if stripped.startswith(THINK_START):
                self.in_reasoning, self.buf = True, stripped[len(THINK_START):]
        if self.in_reasoning:
            end = self.buf.find(THINK_END)
            if end < 0:
                keep = held_back(self.buf, THINK_END)
                reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return reasoning, ""
            reasoning, self.buf, self.in_reasoning = self.buf[:end], self.buf[end + len(THINK_END):], False
            self.after_end = True
        if self.after_end:  # the answer starts at its first non-blank character
            self.buf = self.buf.lstrip()
            self.after_end = not self.buf
        content, self.buf = self.buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output has ended."""
        rest, self.buf = self.buf, ""
        if self.at_start and rest.strip() == THINK_START:  # an opening tag and nothing more
            return "", ""
        if self.at_start and not self.in_reasoning:
            return "", rest
        return (rest, "") if self.in_reasoning else ("", rest)


def split_reasoning(name: str, text: str, template_kwargs: dict | None = None) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output."""
    parser = ReasoningParser(name, template_kwargs)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    reasoning = r1 + r2
    return (reasoning or None), c1 + c2
