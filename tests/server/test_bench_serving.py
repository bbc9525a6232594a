"""moeserve bench serving: its datasets, and full runs against a fake-client server for every backend."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from server_fakes import FakeClient

from moeserve.bench import serving
from moeserve.bench.datasets import random_requests, shared_prefix_requests, sharegpt_requests
from moeserve.models.default_model import default_model_path
from moeserve.server.launch import free_port


@pytest.fixture(scope="module")
def fake(default_tokenizer):
    """conftest's FakeClient with a longer context and the default model's path (bench serving reads it from
    /get_model_info to find the tokenizer); conftest's `base_url` serves it."""
    return FakeClient(default_tokenizer, context_length=4096, model_path=default_model_path())


def test_random_lengths(default_tokenizer):
    reqs = random_requests(default_tokenizer, 50, input_len=40, output_len=20, range_ratio=0.5, seed=0)
    assert len(reqs) == 50
    assert all(10 <= r.output_len <= 20 for r in reqs)
    assert len({r.output_len for r in reqs}) > 3
    # Random ids decode to text that re-tokenizes to roughly the asked length, with no special tokens.
    assert all(10 <= r.prompt_len <= 60 for r in reqs)
    assert not any("<｜" in r.prompt for r in reqs)
    fixed = random_requests(default_tokenizer, 10, input_len=40, output_len=20, range_ratio=1.0, seed=0)
    assert {r.output_len for r in fixed} == {20}
    assert random_requests(default_tokenizer, 50, 40, 20, 0.5, seed=0) == reqs  # seeded
    assert not any("\ufffd" in r.prompt for r in reqs)
    with pytest.raises(ValueError, match="range-ratio"):
        random_requests(default_tokenizer, 1, 4, 4, 1.5, seed=0)


def test_sharegpt(default_tokenizer, tmp_path):
    conv = [
        {"conversations": [{"from": "human", "value": "Tell me a story about a fox and some grapes."},
                           {"from": "gpt", "value": "A hungry fox saw some fine bunches of grapes on a vine."}]},
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there, friend!"}]},
        {"conversations": [{"from": "human", "value": "Only one turn here, no reply at all."}]},
        {"conversations": [{"from": "human", "value": "word " * 2000}, {"from": "gpt", "value": "too long prompt"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conv))
    reqs = sharegpt_requests(default_tokenizer, str(path), num_prompts=10, seed=0)
    assert len(reqs) == 1 and reqs[0].prompt.startswith("Tell me a story")  # the rest fail the filters
    assert reqs[0].output_len == len(default_tokenizer.encode(conv[0]["conversations"][1]["value"],
                                                              add_special_tokens=False))
    assert sharegpt_requests(default_tokenizer, str(path), 10, 0, fixed_output_len=7)[0].output_len == 7


def test_shared_prefix(default_tokenizer):
    reqs = shared_prefix_requests(default_tokenizer, num_groups=3, prompts_per_group=4, system_prompt_len=64,
                                  question_len=8, output_len=5, seed=0)
    assert len(reqs) == 12 and {r.output_len for r in reqs} == {5}
    prefixes = {r.prompt.split("\n\n")[0] for r in reqs}
    assert len(prefixes) == 3


def test_stats():
    s = serving._stats([0.001, 0.002, 0.003, 0.004])
    assert s["mean"] == pytest.approx(2.5) and s["median"] == pytest.approx(2.5)
    assert s["p99"] == pytest.approx(3.97) and s["max"] == pytest.approx(4.0)


@pytest.mark.parametrize("backend", ["moeserve", "openai", "openai-chat"])
def test_run_against_fake_server(base_url, fake, tmp_path, backend, capsys):
    out = tmp_path / "result.json"
    rc = serving.main(["--base-url", base_url, "--backend", backend, "--dataset", "random", "--num-prompts", "12",
                       "--random-input-len", "16", "--random-output-len", "8", "--random-range-ratio", "0.5",
                       "--request-rate", "200", "--max-concurrency", "4", "--output-file", str(out),
                       "--disable-tqdm"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Median TTFT (ms):" in printed
    record = json.loads(out.read_text())
    summary = record["summary"]
    assert summary["completed"] == 12 and summary["failed"] == 0
    assert summary["output_len_mismatches"] == 0
    assert summary["total_output_tokens"] == sum(r["expected_output_len"] for r in record["requests"])
    assert summary["ttft_ms"]["mean"] > 0 and summary["e2e_ms"]["p99"] >= summary["e2e_ms"]["median"]
    assert record["config"]["tokenizer"] == default_model_path()  # asked from /get_model_info
    # The header's prompt tokens are the table's: both count as the server does (BOS, or the chat template).
    header = next(line for line in printed.splitlines() if "prompt tokens" in line)
    assert int(header.split(", ")[1].split()[0]) == summary["total_input_tokens"], (header, summary)
    if backend != "moeserve":
        assert record["config"]["model"] == "fake-model"


def test_failed_requests_are_counted(base_url, capsys):
    rc = serving.main(["--base-url", base_url, "--num-prompts", "5", "--random-input-len", "8",
                       "--random-output-len", "4", "--warmup-requests", "0", "--disable-tqdm",
                       "--extra-request-body", json.dumps({"top_p": 5.0})])
    assert rc == 1
    printed = capsys.readouterr().out
    assert "Failed requests:                                 5" in printed
    assert "top_p" in printed


def test_summary_with_no_success():
    summary = serving.summarize([serving.RequestResult(error="boom")], 1.0)
    assert summary["failed"] == 1 and summary["errors"] == {"boom": 1}
    assert "FAILED x1: boom" in serving.format_report(summary, "openai", math.inf, None)


class _NotYetRouting(BaseHTTPRequestHandler):
    """A router that answers /get_model_info at once but serves a request only from the third probe on."""

    posts = 0

    def do_GET(self):  # noqa: N802 - http.server's name
        self._answer(200, {"model_path": "m", "tokenizer_path": None})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).posts += 1
        assert body["stream"] is False and body["sampling_params"]["max_new_tokens"] == 1
        self._answer(200 if type(self).posts >= 3 else 503, {"text": "x"})

    def _answer(self, status, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_wait_ready_until_a_request_is_served(base_url):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotYetRouting)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        serving.wait_ready(url, "moeserve", timeout_s=30)
        assert _NotYetRouting.posts == 3  # two 503s were waited through
    finally:
        server.shutdown()
    serving.wait_ready(base_url, "openai", timeout_s=30)  # the model name from /v1/models, no stream options
    with pytest.raises(TimeoutError, match="did not serve a one-token request within 1 s"):
        serving.wait_ready(f"http://127.0.0.1:{free_port()}", "moeserve", timeout_s=1)


def test_plot_writes_a_png_beside_the_json(base_url, tmp_path, capsys):
    out = tmp_path / "run.json"
    rc = serving.main(["--base-url", base_url, "--backend", "openai", "--num-prompts", "10", "--random-input-len",
                       "16", "--random-output-len", "8", "--max-concurrency", "4", "--output-file", str(out),
                       "--plot", "--disable-tqdm"])
    assert rc == 0
    png = tmp_path / "run.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"wrote {png}" in capsys.readouterr().out
    sent = [r["sent_s"] for r in json.loads(out.read_text())["requests"]]
    assert all(0 <= s < 60 for s in sent) and max(sent) > 0  # relative to the run's start, not the clock's


@pytest.mark.parametrize("argv,words", [(["--plot"], "--output-file"),
                                        (["--plot", "--output-file", "x.json"], "moeserve[plot]")])
def test_plot_is_refused_before_the_run(monkeypatch, capsys, argv, words):
    monkeypatch.setattr(serving, "have_matplotlib", lambda: False)
    assert serving.main(["--base-url", "http://127.0.0.1:9", *argv]) == 2  # nothing listens there: never reached
    assert words in capsys.readouterr().err
