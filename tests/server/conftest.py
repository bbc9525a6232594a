"""Fixtures for the HTTP server tests."""

from __future__ import annotations

import pytest

from moeserve.models.default_model import default_model_path
from moeserve.text.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def default_tokenizer():
    return load_tokenizer(default_model_path())
