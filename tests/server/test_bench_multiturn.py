"""moeserve bench serving's multi-turn dataset: conversations whose turns go in order with the server's real answers,
against a fake-client server and a real `moeserve serve` (whose prefix cache reports cached tokens)."""

from __future__ import annotations

import asyncio
import json

import pytest
from server_fakes import FakeClient

from moeserve.bench import serving
from moeserve.bench.datasets import TURN_SEP, multiturn_conversations
from moeserve.models.default_model import default_model_path


@pytest.fixture(scope="module")
def fake(default_tokenizer):
    """conftest's FakeClient with a longer context and the default model's path (bench serving reads it from
    /get_model_info to find the tokenizer); conftest's `base_url` serves it."""
    return FakeClient(default_tokenizer, context_length=4096, model_path=default_model_path())


def test_conversations(default_tokenizer):
    convs = multiturn_conversations(default_tokenizer, num_conversations=5, turns=3, system_prompt_len=40,
                                    user_len=12, output_len=6, seed=0)
    assert len(convs) == 5 and {c.output_len for c in convs} == {6}
    assert len({c.system for c in convs}) == 1 and 20 <= len(default_tokenizer.encode(convs[0].system)) <= 80
    users = [u for c in convs for u in c.user_messages]
    assert len(users) == 15 and len(set(users)) == 15  # distinct text: prompts (and routes) vary
    assert multiturn_conversations(default_tokenizer, 5, 3, 40, 12, 6, seed=0) == convs  # seeded
    conv = convs[1]
    first = conv.turn_request(default_tokenizer, [])
    assert first.turn == 1 and first.prompt == conv.system + TURN_SEP + conv.user_messages[0] + TURN_SEP
    assert [m["role"] for m in first.messages] == ["system", "user"]
    third = conv.turn_request(default_tokenizer, ["answer one", "answer two"])
    assert third.turn == 3 and third.prompt == TURN_SEP.join([conv.system, conv.user_messages[0], "answer one",
                                                              conv.user_messages[1], "answer two",
                                                              conv.user_messages[2], ""])
    # each turn's prompt and its answer begin the next turn's prompt: the answer's KV is reused, as in a chat
    second = conv.turn_request(default_tokenizer, ["answer one"])
    assert second.prompt.startswith(first.prompt + "answer one") and third.prompt.startswith(second.prompt + "answer two")
    assert third.prompt_len > first.prompt_len
    assert [m["role"] for m in third.messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert third.messages[4]["content"] == "answer two"
    no_system = multiturn_conversations(default_tokenizer, 1, 1, 0, 8, 4, seed=0)[0]
    assert no_system.turn_request(default_tokenizer, []).prompt == no_system.user_messages[0] + TURN_SEP
    with pytest.raises(ValueError, match="at least one"):
        multiturn_conversations(default_tokenizer, 0, 3, 8, 8, 4, seed=0)


def test_turns_in_order_with_real_answers(fake, base_url, default_tokenizer):
    """Each turn's prompt holds the answer the server gave to the turn before (so it was sent after it arrived), and
    conversations interleave."""
    convs = multiturn_conversations(default_tokenizer, 4, 3, 24, 8, 5, seed=1)
    fake.requests.clear()
    results, duration = asyncio.run(serving.run_benchmark(
        base_url, "moeserve", None, convs, max_concurrency=2, warmup_requests=0, show_progress=False,
        tokenizer=default_tokenizer))
    assert duration > 0 and len(results) == 12 and all(r.success for r in results)
    assert [r.turn for r in results] == [1, 2, 3] * 4
    sent = [obj.text for obj in fake.requests]  # in arrival order
    for c, conv in enumerate(convs):
        turns = results[3 * c:3 * c + 3]
        assert all(r.output_text and r.output_len == 5 for r in turns)
        prompts = [conv.turn_request(default_tokenizer, [r.output_text for r in turns[:k]]) for k in range(3)]
        order = [sent.index(p.prompt) for p in prompts]  # each turn's exact prompt reached the server
        assert order == sorted(order)
        assert turns[0].output_text in prompts[1].prompt and turns[1].output_text in prompts[2].prompt
    # Interleaving: some conversation's first turn arrived after another's second.
    first_turns = [sent.index(conv.turn_request(default_tokenizer, []).prompt) for conv in convs]
    assert max(first_turns) > min(first_turns) + 1


def test_failed_turn_skips_the_rest(base_url, default_tokenizer, capsys):
    rc = serving.main(["--base-url", base_url, "--dataset", "multiturn", "--multiturn-num-conversations", "2",
                       "--multiturn-turns", "3", "--multiturn-system-prompt-len", "8", "--multiturn-user-len", "4",
                       "--multiturn-output-len", "3", "--warmup-requests", "0", "--disable-tqdm",
                       "--extra-request-body", json.dumps({"top_p": 5.0})])
    assert rc == 1
    printed = capsys.readouterr().out
    assert "Failed requests:                                 6" in printed
    assert "FAILED x4: not sent: an earlier turn of its conversation failed" in printed


@pytest.mark.parametrize("backend", ["openai-chat", "openai"])
def test_openai_backends(base_url, tmp_path, backend, capsys):
    out = tmp_path / "result.json"
    rc = serving.main(["--base-url", base_url, "--backend", backend, "--dataset", "multiturn", "--num-clients", "3",
                       "--num-rounds", "2", "--multiturn-system-prompt-len", "16", "--multiturn-user-len", "6",
                       "--multiturn-output-len", "4", "--max-concurrency", "2", "--output-file", str(out),
                       "--disable-tqdm"])
    assert rc == 0
    summary = json.loads(out.read_text())["summary"]
    assert summary["completed"] == 6 and [t["completed"] for t in summary["turns"]] == [3, 3]
    assert summary["turns"][1]["prompt_tokens_mean"] > summary["turns"][0]["prompt_tokens_mean"]
    assert summary["total_cached_tokens"] == 0  # the fake caches nothing, and says so
    assert "Per Turn" in capsys.readouterr().out


def test_real_server_reports_cached_tokens(server, tmp_path, capsys):
    """A real server's prefix cache: later turns find their history cached, and so does the shared system prompt."""
    out = tmp_path / "result.json"
    rc = serving.main(["--base-url", server["url"], "--dataset", "multiturn", "--multiturn-num-conversations", "4",
                       "--multiturn-turns", "3", "--multiturn-system-prompt-len", "64", "--multiturn-user-len", "16",
                       "--multiturn-output-len", "8", "--max-concurrency", "2", "--output-file", str(out),
                       "--disable-tqdm"])
    assert rc == 0
    printed = capsys.readouterr().out
    summary = json.loads(out.read_text())["summary"]
    assert summary["completed"] == 12 and summary["failed"] == 0 and summary["output_len_mismatches"] == 0
    turns = summary["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    # Turn k+1's prompt holds turn k's whole prompt and answer: with nothing evicted, most of it is cached.
    for prev, cur in zip(turns, turns[1:], strict=False):
        assert cur["prompt_tokens_mean"] > prev["prompt_tokens_mean"] + 16
        assert cur["cached_tokens_mean"] >= 0.5 * prev["prompt_tokens_mean"], turns
    assert turns[0]["cached_tokens_mean"] > 0  # the shared system prompt, after the first conversation
    assert summary["total_cached_tokens"] > 0 and "Per Turn" in printed and "Cached prompt tokens (%)" in printed
