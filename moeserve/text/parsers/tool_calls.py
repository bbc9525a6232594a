"""Tool-call parsers (--tool-call-parser, SGLang's names): DeepSeek's tool-call blocks as OpenAI `tool_calls`.

DeepSeek-V3 writes its calls after any content, as

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {"arg": ...}
    ```<｜tool▁call▁end｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(one line per marker here for reading; the model writes them back to back), and V3.1 as
`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{"arg": ...}<｜tool▁call▁end｜>` inside the same pair. The parser is fed
the output's text deltas and returns the content delta and OpenAI's streamed tool-call deltas: a call's id and name
once its header is complete, then its arguments as they come (what may be the start of the closing marker held back).
A call to a function the request did not offer is dropped with a warning. `tool_call_ebnf` is the grammar that
makes the model write one call (tool_choice "required" or a named function), for the `ebnf` sampling parameter.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from moeserve.text.parsers.markers import held_back

logger = logging.getLogger(__name__)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_HOLD = len(CALL_END) + 8  # what the closing fence and marker (and a little whitespace) may take at the tail


@dataclass(frozen=True)
class ToolCallFormat:
    """How one model family writes a call between CALL_BEGIN and CALL_END."""

    name_first: bool  # V3.1: NAME<sep>ARGS; V3: function<sep>NAME\n```json\nARGS\n```
    fence: str = ""  # what closes the header after the name (V3: the opening of a json code block)

    def header(self, name: str) -> str:
        return f"{name}{SEP}" if self.name_first else f"function{SEP}{name}{self.fence}"

    def args_end(self) -> str:
        return "" if self.name_first else "\n```"


TOOL_CALL_PARSERS: dict[str, ToolCallFormat] = {
    "deepseekv3": ToolCallFormat(name_first=False, fence="\n```json\n"),
    "deepseekv31": ToolCallFormat(name_first=True),
}



class ToolCallParser:
    """One output's text -> (content, OpenAI tool-call deltas), delta by delta."""

    def __init__(self, name: str, tool_names: set[str] | None = None):
        self.fmt = TOOL_CALL_PARSERS[name]
        self.tool_names = tool_names
        self.state = "content"  # content -> calls -> (header -> args -> calls)* -> after
        self.buf = ""
        self.index = -1  # the OpenAI index of the call in progress (calls kept so far - 1)
        self.sent = 0  # argument characters of the call in progress already sent
        self.skip = False  # the call in progress names an unknown function

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        self.buf += delta
        content, calls = "", []
        while True:
            if self.state == "content":
                at = self.buf.find(CALLS_BEGIN)
                if at < 0:
                    keep = held_back(self.buf, CALLS_BEGIN)
                    content += self.buf[:len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    return content, calls
                content += self.buf[:at]
                self.buf, self.state = self.buf[at + len(CALLS_BEGIN):], "calls"
            elif self.state == "calls":
                rest = self.buf.lstrip()
                if rest.startswith(CALLS_END):
                    self.buf, self.state = rest[len(CALLS_END):], "after"
                elif rest.startswith(CALL_BEGIN):
                    self.buf, self.state = rest[len(CALL_BEGIN):], "header"
                else:
                    return content, calls  # a marker still coming (or stray text, left for finish)
            elif self.state == "header":
                name = self._header()
                if name is None:
                    return content, calls
                self.skip = self.tool_names is not None and name not in self.tool_names
                if self.skip:
                    logger.warning("the model called %r, which the request did not offer: dropped", name)
                else:
                    self.index += 1
                    self.sent = 0
                    calls.append({"index": self.index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                  "function": {"name": name, "arguments": ""}})
                self.state = "args"
            elif self.state == "args":
                at = self.buf.find(CALL_END)
                if at < 0:
                    self._send_args(self.buf[:max(len(self.buf) - _HOLD, 0)], calls)
                    return content, calls
                self._send_args(self._strip_args(self.buf[:at]), calls)
                self.buf, self.state = self.buf[at + len(CALL_END):], "calls"
            else:  # after the block: whatever follows is content
                content, self.buf = content + self.buf, ""
                return content, calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What was held back, once the output has ended (a call cut short keeps the arguments it has)."""
        calls: list[dict[str, Any]] = []
        rest, self.buf = self.buf, ""
        if self.state == "args":
            self._send_args(self._strip_args(rest), calls)
            return "", calls
        return (rest if self.state in ("content", "after") else ""), calls

    def _header(self) -> str | None:
        """The function name once the call's header is complete (consumed from buf), else None."""
        if self.fmt.name_first:
            at = self.buf.find(SEP)
            if at < 0:
                return None
            name, self.buf = self.buf[:at].strip(), self.buf[at + len(SEP):]
            return name
        prefix = f"function{SEP}"
        start = self.buf.find(prefix)
        end = self.buf.find(self.fmt.fence, start + len(prefix)) if start >= 0 else -1
        if end < 0:
            return None
        name, self.buf = self.buf[start + len(prefix):end].strip(), self.buf[end + len(self.fmt.fence):]
        return name

    def _strip_args(self, args: str) -> str:
        close = self.fmt.args_end()
        args = args.rstrip()
        return args[:-len(close.strip())].rstrip() if close and args.endswith(close.strip()) else args

    def _send_args(self, args: str, calls: list[dict[str, Any]]) -> None:
        if not self.skip and len(args) > self.sent:
            calls.append({"index": self.index, "function": {"arguments": args[self.sent:]}})
            self.sent = len(args)


def merge_deltas(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's message.tool_calls from the streamed deltas."""
    calls: list[dict[str, Any]] = []
    for d in deltas:
        if d["index"] == len(calls):
            calls.append({"id": d["id"], "type": "function", "function": dict(d["function"])})
        else:
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return calls


def parse_tool_calls(name: str, text: str, tool_names: set[str] | None = None) -> tuple[str, list[dict[str, Any]]]:
    """(content, tool_calls) of a whole output."""
    parser = ToolCallParser(name, tool_names)
    c1, d1 = parser.feed(text)
    c2, d2 = parser.finish()
    return c1 + c2, merge_deltas(d1 + d2)


def tool_call_ebnf(name: str, tools: list[dict[str, Any]]) -> str:
    """The grammar (xgrammar's EBNF) of a tool-call block holding one call to one of `tools` (OpenAI's tool
    objects), its arguments valid under the function's JSON schema."""
    import xgrammar as xgr

    fmt = TOOL_CALL_PARSERS[name]

    def literal(text: str) -> xgr.Grammar:
        return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text, ensure_ascii=False)}")

    calls = []
    for tool in tools:
        fn = tool["function"]
        schema = fn.get("parameters") or {"type": "object"}
        calls.append(xgr.Grammar.concat(
            literal(CALL_BEGIN + fmt.header(fn["name"])),
            xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False),
            literal(fmt.args_end() + CALL_END)))
    one = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
    return str(xgr.Grammar.concat(literal(CALLS_BEGIN), one, literal(CALLS_END)))
