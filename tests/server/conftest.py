"""Fixtures for the HTTP server tests."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest
from server_fakes import FakeClient, serve_in_thread

from moeserve.models.default_model import default_model_path
from moeserve.server.http.app import build_app
from moeserve.server.launch import free_port
from moeserve.text.tokenizer import load_tokenizer
from tests.procs import descendants, sigterm_leaves_nothing, wait_healthy


@pytest.fixture(scope="session")
def default_tokenizer():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def fake(default_tokenizer):
    """A FakeClient per test module (tests/server/server_fakes.py)."""
    return FakeClient(default_tokenizer, context_length=512)


@pytest.fixture(scope="module")
def base_url(fake):
    """An HTTP server in a thread over the module's FakeClient."""
    with serve_in_thread(build_app(fake)) as url:
        yield url


# A real `moeserve serve` process on the embedded default model, one for the whole session (test_e2e.py,
# test_structured_outputs_e2e.py, test_bench_multiturn.py, test_sglang_router.py): a start-up costs seconds on two
# cores, and no test here needs a fresh one (those that need an empty cache or an idle server flush or wait). The
# official openai client for the OpenAI API, httpx for the native endpoints. The extra flags change nothing for a
# request that does not ask for them.
@pytest.fixture(scope="session")
def server(tmp_path_factory):
    from moeserve.models.default_model import default_model_path

    model_path = default_model_path()  # built before the server starts, so the timeout below is for serving
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [sys.executable, "-m", "moeserve.cli", "serve", "--port", str(port), "--served-model-name", "tiny",
           "--model-path", model_path, "--expert-distribution-recorder-mode", "stat",
           "--tool-call-parser", "deepseekv3",  # only requests with tools see it
           "--reasoning-parser", "deepseek-v3"]  # only requests with chat_template_kwargs {"thinking": true}
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, log, 180)
    workers = descendants(proc.pid)
    yield {"url": url, "proc": proc, "log": log, "model_path": model_path, "workers": workers}

    # Clean shutdown on SIGTERM: exit code 0, and no worker process left behind.
    sigterm_leaves_nothing(proc, workers, log, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server["url"], timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="none", max_retries=0, timeout=120)
