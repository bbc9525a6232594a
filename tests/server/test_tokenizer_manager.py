"""The TokenizerManager over a fake rank client: request ids unique without races, failures as errors, and long
prompts refused or tokenized without stalling the event loop."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from moeserve.args import ServerArgs
from moeserve.rank.io_struct import AbortReq, FinishReason, GenerateReq, TokenOut
from moeserve.server import startup, tokenizer_manager
from moeserve.server.tokenizer_manager import (
    GenerateInput,
    InvalidRequestError,
    RequestFailedError,
)


@dataclass
class _Ready:
    context_length: int = 256
    vocab_size: int = 1024
    num_kv_tokens: int = 4096
    weight_format: str = "bfloat16"


class FakeRanks:
    """RankClient's shape: records what the manager sends; the test delivers outputs through on_outputs."""

    def __init__(self, server_args):
        self.ready = _Ready()
        self.healthy = True
        self.dead_reason = None
        self.sent: list = []

    def listen(self, on_outputs, on_load, on_dead):
        self.on_outputs = on_outputs

    def send(self, dp_rank, msg):
        self.sent.append(msg)

    def shutdown(self):
        pass


@pytest.fixture()
def tm(monkeypatch):
    monkeypatch.setattr(startup, "RankClient", FakeRanks)
    manager = startup.start_engine(ServerArgs())
    yield manager
    manager.shutdown()


def _deliver(tm, wire_id, ids, finish=None):
    tm._deliver([TokenOut(wire_id, ids, finish, 3, len(ids), 0)])


async def _drain(gen) -> list[dict]:
    return [out async for out in gen]


def test_a_reused_rid_never_gets_the_earlier_requests_outputs(tm):
    async def run():
        a = tm.generate(GenerateInput(input_ids=[5, 6, 7], rid="x", stream=True,
                                      sampling_params={"max_new_tokens": 5}))
        first = asyncio.ensure_future(a.__anext__())
        await asyncio.sleep(0)
        wire_a = tm.ranks.sent[-1].rid
        _deliver(tm, wire_a, [9])
        assert (await first)["output_ids"] == [9]
        await tm.abort("x")  # /abort_request; the rank has not seen the AbortReq yet
        assert [o["meta_info"]["finish_reason"]["type"] for o in await _drain(a)] == ["abort"]
        assert isinstance(tm.ranks.sent[-1], AbortReq) and tm.ranks.sent[-1].rid == wire_a

        b = asyncio.ensure_future(_drain(tm.generate(GenerateInput(input_ids=[5, 6, 7], rid="x",
                                                                   sampling_params={"max_new_tokens": 2}))))
        await asyncio.sleep(0)
        wire_b = tm.ranks.sent[-1].rid
        assert isinstance(tm.ranks.sent[-1], GenerateReq) and wire_b != wire_a
        # the rank's late answer to the abort of A, then B's own tokens
        _deliver(tm, wire_a, [], FinishReason("abort", message="aborted by request"))
        _deliver(tm, wire_b, [11])
        _deliver(tm, wire_b, [12], FinishReason("length"))
        (out,) = await b
        assert out["output_ids"] == [11, 12] and out["meta_info"]["finish_reason"] == {"type": "length"}
        assert out["meta_info"]["id"] == "x"

    asyncio.run(run())


def test_a_live_rid_is_refused_as_duplicate(tm):
    async def run():
        a = asyncio.ensure_future(_drain(tm.generate(GenerateInput(input_ids=[5, 6], rid="y"))))
        await asyncio.sleep(0)
        with pytest.raises(InvalidRequestError) as e:
            await _drain(tm.generate(GenerateInput(input_ids=[5, 6], rid="y")))
        assert e.value.code == "duplicate_rid" and e.value.param == "rid"
        _deliver(tm, tm.ranks.sent[-1].rid, [7], FinishReason("length"))
        await a
        again = tm.generate(GenerateInput(input_ids=[5, 6], rid="y"))  # free once the first one finished
        pending = asyncio.ensure_future(again.__anext__())
        await asyncio.sleep(0)
        assert isinstance(tm.ranks.sent[-1], GenerateReq)
        pending.cancel()

    asyncio.run(run())


@pytest.mark.parametrize("status,error", [(400, InvalidRequestError), (500, RequestFailedError)])
def test_a_failure_from_the_ranks_is_an_error_not_an_answer(tm, status, error):
    async def run():
        gen = asyncio.ensure_future(_drain(tm.generate(GenerateInput(input_ids=[5, 6]))))
        await asyncio.sleep(0)
        _deliver(tm, tm.ranks.sent[-1].rid, [], FinishReason("abort", message="non-finite logits",
                                                             status_code=status))
        with pytest.raises(error, match="non-finite"):
            await gen

    asyncio.run(run())


def test_an_over_long_text_is_refused_before_tokenizing(tm, monkeypatch):
    limit = tm.validator.max_prompt_chars
    assert limit == 256 * tm.tokenizer.max_token_bytes
    calls = []
    monkeypatch.setattr(tm.tokenizer, "encode", lambda *a, **k: calls.append(1) or [1])

    async def run():
        with pytest.raises(InvalidRequestError, match="was not tokenized"):
            await _drain(tm.generate(GenerateInput(text="x" * (limit + 1))))

    asyncio.run(run())
    assert calls == []


def test_tokenizing_a_long_text_leaves_the_loop_free(tm):
    """A text just under the limit is tokenized in a worker thread without the GIL: the loop keeps ticking."""
    from moeserve.server.validation import RequestValidator

    tm.validator = RequestValidator(tm.tokenizer, 1024, 16384, 1 << 20)  # room for a 475,000-character prompt
    text = "The Tortoise and the Hare. " * (tm.validator.max_prompt_chars // 27)

    async def run():
        gaps = []

        async def ticker():
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.ensure_future(ticker())
        start = time.perf_counter()
        with pytest.raises(InvalidRequestError, match="context length"):  # tokenized, then too long
            await _drain(tm.generate(GenerateInput(text=text)))
        tick.cancel()
        return max(gaps), time.perf_counter() - start

    worst_gap, took = asyncio.run(run())
    # the loop kept running while it tokenized: had the tokenizing blocked it, one gap would span most of the time
    assert took > 0.1 and worst_gap < took / 3, (worst_gap, took)


def test_a_long_answer_is_detokenized_off_the_loop(tm):
    """A non-streamed answer arrives in one output; thousands of tokens are decoded in a worker thread."""
    ids = tm.tokenizer.encode("The Tortoise and the Hare. " * 3000, add_special_tokens=False)
    assert len(ids) > tokenizer_manager.INLINE_DETOKENIZE_IDS

    async def run():
        gen = asyncio.ensure_future(_drain(tm.generate(GenerateInput(input_ids=[5, 6],
                                                                     sampling_params={"max_new_tokens": 200}))))
        await asyncio.sleep(0)
        _deliver(tm, tm.ranks.sent[-1].rid, ids, FinishReason("length"))
        (out,) = await gen
        return out

    out = asyncio.run(run())
    assert out["text"] == tm.tokenizer.decode(ids) and out["output_ids"] == ids


@pytest.mark.parametrize("args,sampling_params,param,words", [
    ({}, {"regex": "(a"}, "regex", "invalid regex"),
    ({}, {"json_schema": '{"type": "object", "required": 3}'}, "json_schema", "invalid json_schema"),
    ({"grammar_backend": "none"}, {"ebnf": 'root ::= "a"'}, "ebnf", "--grammar-backend none"),
    ({"disaggregation_mode": "decode"}, {"regex": "a"}, "regex", "PD disaggregation"),
])
def test_a_grammar_the_server_cannot_serve_is_refused_before_the_ranks(monkeypatch, args, sampling_params, param,
                                                                         words):
    monkeypatch.setattr(startup, "RankClient", FakeRanks)
    manager = startup.start_engine(ServerArgs(**args))
    try:
        with pytest.raises(InvalidRequestError, match=words) as e:
            asyncio.run(_drain(manager.generate(GenerateInput(text="x", sampling_params=sampling_params))))
        assert e.value.param == param and manager.ranks.sent == []
    finally:
        manager.shutdown()
