"""Reading a request body: its JSON and its pydantic model, where every malformed body is a 400 naming what is
wrong, and no body stalls the server.

Limits, the same on every endpoint (docs/reliability.md):
- at most MAX_BODY_BYTES (413 beyond);
- nesting at most MAX_JSON_DEPTH levels (json's C parser raised RecursionError, a 500, at about 1,000);
- no array or object with more entries than the server's `max_entries` (its context length, or more where the
  vocabulary or the batch limit is larger): nothing in a request needs more, and validating it would cost time;
- strings valid Unicode (JSON escapes can spell lone UTF-16 surrogates, "\\ud800", which no tokenizer takes).

Bodies up to INLINE_BODY_BYTES (256 KiB) are parsed by json and validated on the event loop (a few ms at most).
Larger ones go to a worker thread, and are parsed there by ijson 64 KiB at a time, so that the event loop runs
between chunks: json.loads holds the GIL for the whole body (0.3 s for four million token ids, during which no
other thread of the process runs). Before that, a scan of the raw bytes checks the nesting depth and the surrogate
escapes (ijson's builder needs memory quadratic in the depth, and turns a lone surrogate into "?").
"""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ijson
from pydantic import BaseModel, ValidationError

from moeserve.server.http.errors import APIError, validation_message

MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_JSON_DEPTH = 64
INLINE_BODY_BYTES = 1 << 18
_CHUNK = 1 << 16  # bytes ijson parses at a time; also the scan's window

_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="moeserve-body")


async def read_body(raw: bytes, model: type[BaseModel], what: str, max_entries: int) -> Any:
    """`raw` parsed and validated into `model` (a large body in a worker thread); APIError for every problem."""
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(f"the request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}", 413,
                       code="body_too_large")
    if len(raw) <= INLINE_BODY_BYTES:
        return validate(parse_json(raw, max_entries), model, what)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_POOL, lambda: validate(parse_json(raw, max_entries), model, what))


def validate(value: Any, model: type[BaseModel], what: str) -> Any:
    if not isinstance(value, dict):
        raise APIError(f"the request body must be a JSON object, got {type(value).__name__}", 400,
                       code="invalid_json")
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise validation_message(e, what) from None


def parse_json(raw: bytes, max_entries: int) -> Any:
    """The JSON value of a request body within the limits above; APIError (400) otherwise."""
    if not raw.strip():
        raise APIError("the request body is empty; send a JSON object", 400, code="invalid_json")
    if len(raw) <= INLINE_BODY_BYTES:
        value = _parse_small(raw)
        _check_tree(value, max_entries, strings=True)
    else:
        _scan_raw(raw)
        value = _parse_large(raw)
        _check_tree(value, max_entries, strings=False)  # the raw scan checked the escapes
    return value


# ----------------------------------------------------------------------
# parsers
def _parse_small(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(f"the request body is not valid UTF-8 (bad byte at offset {e.start})", 400,
                       code="invalid_utf8") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise APIError(f"the request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})", 400,
                       code="invalid_json") from None
    except RecursionError:
        raise _too_deep() from None
    except ValueError as e:
        raise APIError(str(e), 400, code="invalid_json") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"the request body holds {name}, which is not valid JSON")


class _Chunks:
    """A file over `raw` whose read() is Python code: between two chunks the parser runs bytecode, where the
    interpreter can hand the GIL to the event loop's thread."""

    def __init__(self, raw: bytes):
        self.view = memoryview(raw)
        self.pos = 0

    def read(self, n: int) -> bytes:
        chunk = bytes(self.view[self.pos:self.pos + n])
        self.pos += len(chunk)
        return chunk


def _parse_large(raw: bytes) -> Any:
    try:
        values = list(ijson.items(_Chunks(raw), "", use_float=True, buf_size=_CHUNK))
    except ijson.JSONError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "integer overflow" in first:
            first = "an integer beyond 64 bits (a body over 256 KiB cannot hold one)"
        raise APIError(f"the request body is not valid JSON: {first}", 400, code="invalid_json") from None
    if len(values) != 1:
        raise APIError("the request body is not valid JSON: expected one value", 400, code="invalid_json")
    return values[0]


# ----------------------------------------------------------------------
# checks
def _too_deep() -> APIError:
    return APIError(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep", 400,
                    code="nested_too_deep")


def _check_tree(value: Any, max_entries: int, strings: bool) -> None:
    """Depth, entries and (with `strings`) Unicode of a parsed body, walked without recursion."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, str):
            if strings:
                _check_string(v, path)
        elif isinstance(v, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise _too_deep()
            if len(v) > max_entries:
                kind = "an object" if isinstance(v, dict) else "an array"
                raise APIError(f"{path or 'the body'}: {kind} of {len(v)} entries; this server takes at most "
                               f"{max_entries}", 400, param=path or None, code="too_many_entries")
            if isinstance(v, dict):
                for k, item in v.items():
                    if strings:
                        _check_string(k, path)
                    stack.append((item, f"{path}.{k}" if path else str(k), depth + 1))
            else:
                for i, item in enumerate(v):
                    if isinstance(item, (dict, list, str)):
                        stack.append((item, f"{path}[{i}]", depth + 1))


def _check_string(s: str, path: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(f"{path or 'the body'}: the string holds an unpaired UTF-16 surrogate (invalid Unicode)", 400,
                       param=path or None, code="invalid_unicode") from None


_OUTSIDE = re.compile(rb'["\[\]{}]')  # what matters between strings
_INSIDE = re.compile(rb'["\\]')  # what matters inside one


def _scan_raw(raw: bytes) -> None:
    """Nesting depth and surrogate escapes of a raw body, in windows of _CHUNK bytes (each regex search holds the
    GIL only that long); the parser finds any other error."""
    depth, pos, n, in_string = 0, 0, len(raw), False
    while pos < n:
        end = min(n, pos + _CHUNK)
        m = (_INSIDE if in_string else _OUTSIDE).search(raw, pos, end)
        if m is None:
            pos = end
            continue
        j = m.start()
        c = raw[j]
        if in_string:
            if c == 0x22:  # '"'
                in_string = False
                pos = j + 1
            else:  # a backslash: skip the escaped character, checking \u escapes
                pos = j + 2 + (_check_escape(raw, j) if raw[j + 1:j + 2] == b"u" else 0)
        else:
            if c == 0x22:
                in_string = True
            elif c in (0x5B, 0x7B):  # '[', '{'
                depth += 1
                if depth > MAX_JSON_DEPTH:
                    raise _too_deep()
            else:
                depth -= 1
            pos = j + 1


def _check_escape(raw: bytes, j: int) -> int:
    """A \\uXXXX escape at raw[j]: refuse a lone surrogate; the extra bytes to skip after the 'u'."""
    code = _hex4(raw, j + 2)
    if code is None or not 0xD800 <= code <= 0xDFFF:
        return 4 if code is not None else 0
    if code <= 0xDBFF and raw[j + 6:j + 8] == b"\\u" and 0xDC00 <= (_hex4(raw, j + 8) or 0) <= 0xDFFF:
        return 10  # a pair: one character
    raise APIError("the request body holds an unpaired UTF-16 surrogate escape (invalid Unicode)", 400,
                   code="invalid_unicode")


def _hex4(raw: bytes, i: int) -> int | None:
    try:
        return int(raw[i:i + 4], 16) if len(raw[i:i + 4]) == 4 else None
    except ValueError:
        return None
