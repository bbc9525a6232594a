"""Request bodies: every malformed one is a 400 naming the problem (never a 500), on the inline path (json) and the
large-body path (ijson in a worker thread, after a scan of the raw bytes), which agree."""

from __future__ import annotations

import json

import pytest

from moeserve.server.http.errors import APIError
from moeserve.server.http.json_body import INLINE_BODY_BYTES, MAX_BODY_BYTES, MAX_JSON_DEPTH, parse_json

PAD = " " * (INLINE_BODY_BYTES + 10)  # whitespace that puts a body on the large-body path


def _parse(body: bytes, large: bool, max_entries: int = 10_000):
    return parse_json(body + PAD.encode() if large else body, max_entries)


def _code(body: bytes, large: bool, max_entries: int = 10_000) -> str:
    with pytest.raises(APIError) as e:
        _parse(body, large, max_entries)
    assert e.value.status == 400, e.value.message
    return e.value.code


@pytest.mark.parametrize("large", [False, True])
def test_valid_bodies_parse_the_same(large):
    value = {"text": ["a", "ü", "\n\"\\", "😀"], "input_ids": [[1, 2, 3], [4]], "sampling_params": {
        "temperature": 0.5, "seed": -3, "stop": ["\\u"], "ignore_eos": True, "x": None},
        "deep": [[[[{"k": [1.5e3]}]]]]}
    raw = json.dumps(value).encode()
    assert _parse(raw, large) == value
    assert _parse(json.dumps(value, ensure_ascii=False).encode(), large) == value


@pytest.mark.parametrize("large", [False, True])
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1000, 100_000])
def test_deep_nesting_is_a_400(large, depth):
    body = b'{"metadata": {"a": ' + b"[" * depth + b"]" * depth + b"}}"
    assert _code(body, large) == "nested_too_deep"


@pytest.mark.parametrize("large", [False, True])
def test_nesting_at_the_limit_is_fine(large):
    depth = MAX_JSON_DEPTH - 1  # the object itself is one level
    assert _parse(b'{"a": ' + b"[" * depth + b"]" * depth + b"}", large)


@pytest.mark.parametrize("large", [False, True])
@pytest.mark.parametrize("body,code", [
    (b'{"text": "\\ud800"}', "invalid_unicode"),
    (b'{"text": "\\udc00 x"}', "invalid_unicode"),
    (b'{"text": "\\ud83d\\u0041"}', "invalid_unicode"),
    (b'{"text": "\\xff"}'.replace(b"\\xff", b"\xff"), None),
    (b'{"text": "x",', "invalid_json"),
    (b'{"text": "x"} {"more": 1}', "invalid_json"),
    (b'{"text": NaN}', "invalid_json"),
])
def test_malformed_bodies_are_400s(large, body, code):
    got = _code(body, large)
    if code is not None:
        assert got == code
    assert got in ("invalid_json", "invalid_unicode", "invalid_utf8")


@pytest.mark.parametrize("large", [False, True])
def test_escaped_backslash_u_is_not_a_surrogate(large):
    assert _parse(b'{"text": "\\\\ud800"}', large) == {"text": "\\ud800"}


@pytest.mark.parametrize("large", [False, True])
def test_too_many_entries(large):
    assert _code(json.dumps({"input_ids": list(range(101))}).encode(), large, max_entries=100) == "too_many_entries"
    assert _parse(json.dumps({"input_ids": list(range(100))}).encode(), large, max_entries=100)


def test_body_size_limit():
    import asyncio

    from pydantic import BaseModel

    from moeserve.server.http.json_body import read_body

    class M(BaseModel):
        pass

    with pytest.raises(APIError) as e:
        asyncio.run(read_body(b" " * (MAX_BODY_BYTES + 1), M, "x", 10))
    assert e.value.status == 413


def test_large_bodies_are_refused_from_the_raw_bytes():
    """Over a limit, a large body is refused by the scan before it is parsed (a 64 MB string alone takes the GIL
    for 0.1 s to build): a string longer than the longest prompt, an array with too many entries."""
    from moeserve.server.http import json_body

    calls = []
    real = json_body._parse_large
    json_body._parse_large = lambda raw: calls.append(1) or real(raw)
    try:
        long_text = json.dumps({"text": "x" * (INLINE_BODY_BYTES + 100)}).encode()
        with pytest.raises(APIError) as e:
            parse_json(long_text, 10_000, max_string_bytes=INLINE_BODY_BYTES)
        assert e.value.code == "context_length_exceeded"
        escaped = json.dumps({"text": "\n" * (INLINE_BODY_BYTES // 2 + 10)}).encode()  # 2 bytes written for 1
        assert parse_json(escaped, 10_000, max_string_bytes=INLINE_BODY_BYTES // 2 + 10)
        ids = json.dumps({"prompt": list(range(200_000))}).encode()
        with pytest.raises(APIError) as e:
            parse_json(ids, 100_000)
        assert e.value.code == "too_many_entries"
        nested = json.dumps({"a": [[1, 2]] * 1000, "b": "x,y" * 100_000}).encode()  # commas in strings, inner lists
        assert parse_json(nested, 1000)
        assert calls == [1, 1]
    finally:
        json_body._parse_large = real
