"""Shared fixtures: tiny checkpoints (built once per session, keyed by name) and their transformers models."""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable

import pytest

from tests.checkpoints import (
    SHIPPED,
    build_checkpoint,
    build_fp8_checkpoint,
    build_mtp_checkpoint,
    quantize_checkpoint,
)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """tiny_checkpoint(name, sharded=False) -> directory of checkpoint `name` (see tests/checkpoints.py SPECS), or
    of the shipped default model for name "shipped".

    With MOESERVE_TEST_CHECKPOINTS=DIR, DIR/NAME is used where it exists (prebuilt checkpoints for a machine
    whose transformers differs, e.g. the GPU machine).
    """
    built: dict[tuple[str, bool], str] = {}
    prebuilt = os.environ.get("MOESERVE_TEST_CHECKPOINTS")

    def get(name: str, sharded: bool = False) -> str:
        if name == SHIPPED:  # the trained default model, as it ships
            from moeserve.models.default_model import default_model_path

            return default_model_path()
        if prebuilt and not sharded and os.path.isdir(os.path.join(prebuilt, name)):
            return os.path.join(prebuilt, name)
        if (name, sharded) not in built:
            out = tmp_path_factory.mktemp(name + ("-sharded" if sharded else ""))
            built[name, sharded] = build_checkpoint(name, out, sharded=sharded)
        return built[name, sharded]

    return get


@pytest.fixture(scope="session")
def fp8_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(FP8 checkpoint in DeepSeek's layout, the same model with the dequantized weights in float32) of v3_fp8."""
    return build_fp8_checkpoint("v3_fp8", tmp_path_factory.mktemp("v3_fp8"))


@pytest.fixture(scope="session")
def mtp_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """v3_q_lora with DeepSeek's MTP layer in the published layout (model.layers.3.*), float32."""
    return build_mtp_checkpoint("v3_q_lora", tmp_path_factory.mktemp("v3_mtp"))


@pytest.fixture(scope="session")
def fp8_mtp_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(FP8 checkpoint in DeepSeek's layout, its dequantized float32 twin) of v3_fp8 with an MTP layer."""
    out = tmp_path_factory.mktemp("v3_fp8_mtp")
    return quantize_checkpoint(build_mtp_checkpoint("v3_fp8", out / "plain"), out)


@pytest.fixture(scope="session")
def shipped_fp8_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(FP8 checkpoint in DeepSeek's layout, the dequantized float32 reference) of the trained default model."""
    from moeserve.models.default_model import default_model_path

    return quantize_checkpoint(default_model_path(), tmp_path_factory.mktemp("shipped_fp8"))


@pytest.fixture(scope="session")
def hf_model(tiny_checkpoint: Callable[..., str]) -> Callable[[str], object]:
    """hf_model(name) -> transformers' model loaded from tiny_checkpoint(name), float32, eager attention."""
    import torch
    import transformers

    loaded: dict[str, object] = {}

    def get(name: str) -> object:
        if name not in loaded:
            loaded[name] = transformers.AutoModelForCausalLM.from_pretrained(
                tiny_checkpoint(name), dtype=torch.float32, attn_implementation="eager").eval()
        return loaded[name]

    return get


def _quiet_interpreter_teardown() -> None:
    # At interpreter exit libtriton's nanobind lists the objects it still holds ("nanobind: leaked 12 instances!",
    # about 35 lines after the summary, which read like a crash). They are teardown diagnostics, not test
    # results: stderr goes to /dev/null once the session is over, as Triton does for its own compile workers.
    sys.stdout.flush()
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


def pytest_unconfigure(config: pytest.Config) -> None:
    """After the summary: silence what the interpreter's teardown writes to stderr where Triton was loaded."""
    if "triton" in sys.modules and not os.environ.get("MOESERVE_TEST_TEARDOWN_STDERR"):
        atexit.register(_quiet_interpreter_teardown)
