"""Reading a request body: its JSON and its pydantic model, where every malformed body is a 400 naming what is
wrong, and no body stalls the server.

Limits, the same on every endpoint (docs/reliability.md):
- at most MAX_BODY_BYTES (413 beyond);
- nesting at most MAX_JSON_DEPTH levels (json's C parser raised RecursionError, a 500, at about 1,000);
- no array or object with more entries than the server's `max_entries` (its context length, or more where the
  vocabulary or the batch limit is larger): nothing in a request needs more, and validating it would cost time;
- strings valid Unicode (JSON escapes can spell lone UTF-16 surrogates, "\\ud800", which no tokenizer takes);
- on the large-body path, no string longer than the longest prompt the context can hold (the server's
  `max_string_bytes`: context length x the longest token), refused before the body is parsed.

Bodies up to INLINE_BODY_BYTES (256 KiB) are parsed by json and validated on the event loop (a few ms at most).
Larger ones go to a worker thread, and are parsed there by ijson 1 MiB at a time, so that the event loop runs
between chunks: json.loads holds the GIL for the whole body (0.3 s for four million token ids, during which no
other thread of the process runs). Before that, a scan of the raw bytes (64 KiB at a time) checks the limits, so
that a body over them is refused without being parsed at all (making a 64 MB string alone holds the GIL for
0.1 s), and so do surrogate escapes (ijson's builder needs memory quadratic in the depth, and turns a lone
surrogate into "?").
"""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ijson
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from moeserve.server.http.errors import APIError, validation_message

MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_JSON_DEPTH = 64
INLINE_BODY_BYTES = 1 << 18
_CHUNK = 1 << 16  # the raw scan's window
_PARSE_CHUNK = 1 << 20  # bytes ijson parses at a time (it copies a string that spans chunks once per chunk)

_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="moeserve-body")


async def receive_body(request: Request) -> bytearray:
    """The request's body, refused (413) as soon as it passes MAX_BODY_BYTES. Appended chunk by chunk, so that
    the memory of a large body is touched a little at a time (one join of 64 MiB holds the loop for 60 ms)."""
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise _too_large(len(body))
    except ClientDisconnect:  # nobody reads the answer: a 400 closes quietly, not a 500 with a traceback
        raise APIError(f"the client disconnected after {len(body)} bytes of its body", 400,
                       code="client_disconnected") from None
    return body


async def read_body(raw: bytes | bytearray, model: type[BaseModel], what: str, max_entries: int,
                    max_string_bytes: int = MAX_BODY_BYTES) -> Any:
    """`raw` parsed and validated into `model` (a large body in a worker thread); APIError for every problem."""
    if len(raw) > MAX_BODY_BYTES:
        raise _too_large(len(raw))
    if len(raw) <= INLINE_BODY_BYTES:
        return validate(parse_json(raw, max_entries, max_string_bytes), model, what)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(
        _POOL, lambda: validate(parse_json(raw, max_entries, max_string_bytes), model, what))


def validate(value: Any, model: type[BaseModel], what: str) -> Any:
    if not isinstance(value, dict):
        raise APIError(f"the request body must be a JSON object, got {type(value).__name__}", 400,
                       code="invalid_json")
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise validation_message(e, what) from None


def parse_json(raw: bytes | bytearray, max_entries: int, max_string_bytes: int = MAX_BODY_BYTES) -> Any:
    """The JSON value of a request body within the limits above; APIError (400) otherwise. `max_string_bytes` is
    checked on the large-body path only, before parsing (a small body's strings are small)."""
    if not raw or raw.isspace():
        raise APIError("the request body is empty; send a JSON object", 400, code="invalid_json")
    if len(raw) <= INLINE_BODY_BYTES:
        value = _parse_small(raw)
        _check_tree(value, max_entries, strings=True)
    else:
        _scan_raw(raw, max_entries, max_string_bytes)
        value = _parse_large(raw)
        _check_tree(value, max_entries, strings=False)  # the raw scan checked the escapes
    return value


# ----------------------------------------------------------------------
# parsers
def _parse_small(raw: bytes | bytearray) -> Any:
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

    def __init__(self, raw: bytes | bytearray):
        self.view = memoryview(raw)
        self.pos = 0

    def read(self, n: int) -> bytes:
        chunk = bytes(self.view[self.pos:self.pos + n])
        self.pos += len(chunk)
        return chunk


def _parse_large(raw: bytes | bytearray) -> Any:
    try:
        values = list(ijson.items(_Chunks(raw), "", use_float=True, buf_size=_PARSE_CHUNK))
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
def _too_large(size: int) -> APIError:
    return APIError(f"the request body is {'over ' if size > MAX_BODY_BYTES else ''}{size} bytes; the limit is "
                    f"{MAX_BODY_BYTES}", 413, code="body_too_large")


def _too_many(max_entries: int) -> APIError:
    return APIError(f"the request body holds an array or object of more than {max_entries} entries; this server "
                    f"takes at most {max_entries}", 400, code="too_many_entries")


def _too_long(max_string_bytes: int) -> APIError:
    return APIError(f"the request body holds a string of more than {max_string_bytes} bytes, longer than any prompt "
                    "within the context length (context length x the longest token); it was not parsed", 400,
                    code="context_length_exceeded")


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


_OUTSIDE = re.compile(rb'["\[\]{}]')  # what matters between strings (commas are counted, not matched)
_INSIDE = re.compile(rb'["\\]')  # what matters inside one
_ESCAPE_OVERHEAD = {0: 1, 4: 5, 10: 10}  # \n: 2 bytes for 1; \u0041: 6 for 1; a surrogate pair: 12 for 4


def _scan_raw(raw: bytes | bytearray, max_entries: int, max_string_bytes: int) -> None:
    """Limits of a raw body, before it is parsed, in windows of _CHUNK bytes (each regex search or count holds the
    GIL that long at most): nesting depth, entries per array or object (its commas), each string's length (at
    least its bytes less what its escapes add), lone surrogate escapes. The parser finds any other error."""
    counts: list[int] = []  # commas in each open array or object
    pos, n, in_string, start, escaped = 0, len(raw), False, 0, 0
    while pos < n:
        end = min(n, pos + _CHUNK)
        m = (_INSIDE if in_string else _OUTSIDE).search(raw, pos, end)
        j = m.start() if m is not None else end
        if not in_string and counts:
            counts[-1] += raw.count(b",", pos, j)
            if counts[-1] >= max_entries:
                raise _too_many(max_entries)
        if m is None:
            if in_string and end - start - escaped > max_string_bytes:  # no need to find its end
                raise _too_long(max_string_bytes)
            pos = end
            continue
        c = raw[j]
        if in_string:
            if c == 0x22:  # '"': the string ends
                in_string = False
                if j - start - escaped > max_string_bytes:
                    raise _too_long(max_string_bytes)
                pos = j + 1
            else:  # a backslash: skip the escaped character, checking \u escapes
                extra = _check_escape(raw, j) if raw[j + 1:j + 2] == b"u" else 0
                escaped += _ESCAPE_OVERHEAD[extra]  # bytes written beyond the UTF-8 they stand for, at most
                pos = j + 2 + extra
        elif c == 0x22:
            in_string, start, escaped = True, j + 1, 0
            pos = j + 1
        else:
            if c in (0x5B, 0x7B):  # '[', '{'
                counts.append(0)
                if len(counts) > MAX_JSON_DEPTH:
                    raise _too_deep()
            elif counts:
                counts.pop()
            pos = j + 1


def _check_escape(raw: bytes | bytearray, j: int) -> int:
    """A \\uXXXX escape at raw[j]: refuse a lone surrogate; the extra bytes to skip after the 'u'."""
    code = _hex4(raw, j + 2)
    if code is None or not 0xD800 <= code <= 0xDFFF:
        return 4 if code is not None else 0
    if code <= 0xDBFF and raw[j + 6:j + 8] == b"\\u" and 0xDC00 <= (_hex4(raw, j + 8) or 0) <= 0xDFFF:
        return 10  # a pair: one character
    raise APIError("the request body holds an unpaired UTF-16 surrogate escape (invalid Unicode)", 400,
                   code="invalid_unicode")


def _hex4(raw: bytes | bytearray, i: int) -> int | None:
    try:
        return int(raw[i:i + 4], 16) if len(raw[i:i + 4]) == 4 else None
    except ValueError:
        return None
