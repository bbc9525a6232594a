"""Fixtures for the HTTP server tests."""

from __future__ import annotations

import pytest
from server_fakes import FakeClient, serve_in_thread

from moeserve.models.default_model import default_model_path
from moeserve.server.http.app import build_app
from moeserve.text.tokenizer import load_tokenizer


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
