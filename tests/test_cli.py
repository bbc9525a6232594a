"""The `moeserve` command line: SGLang's flag aliases, help that says each default once, and `generate`'s own flags."""

from __future__ import annotations

import argparse
import re

import pytest

from moeserve.args import SERVE_ONLY_FLAGS, ServerArgs
from moeserve.cli import _server_parser


def _parse(argv: list[str]) -> ServerArgs:
    parser = _server_parser("moeserve serve", "")
    return ServerArgs.from_cli_args(parser.parse_args(argv))


@pytest.mark.parametrize("argv", [
    ["--tp-size", "4", "--dp-size", "2", "--ep-size", "4", "--enable-dp-attention"],
    ["--tp", "4", "--dp", "2", "--ep", "4", "--enable-dp-attention"],
    ["--tensor-parallel-size", "4", "--data-parallel-size", "2", "--expert-parallel-size", "4",
     "--enable-dp-attention"],
])
def test_sglang_aliases(argv):
    args = _parse(argv)
    assert (args.tp_size, args.dp_size, args.ep_size) == (4, 2, 4)


def test_serve_help_says_each_default_once(capsys):
    with pytest.raises(SystemExit):
        _server_parser("moeserve serve", "").parse_args(["--help"])
    text = capsys.readouterr().out
    assert "(default: 30000)" in text
    assert not re.search(r"\(default: [^)]*\)\s*\(default:", text), "a default printed twice"
    assert text.count("(default: 30000)") == 1


def test_generate_help_has_its_own_flags_and_no_serve_only_ones(capsys):
    from moeserve.cli import cmd_generate

    with pytest.raises(SystemExit):
        cmd_generate(["--help"])
    text = capsys.readouterr().out
    own = text[text.index("\ngeneration:"):]
    for flag in ("--max-new-tokens", "--temperature", "--top-p", "--top-k", "--seed"):
        line = own[own.index(flag):].split("\n  --", 1)[0]
        assert "default" in line, (flag, line)
    for name in SERVE_ONLY_FLAGS:
        assert f"--{name.replace('_', '-')} " not in text, name
    assert "--model-path" in text and "--tp-size" in text


def test_shutdown_timeout_flag():
    assert _parse([]).shutdown_timeout == 20.0
    assert _parse(["--shutdown-timeout", "0"]).shutdown_timeout == 0
    with pytest.raises(ValueError, match="shutdown-timeout"):
        ServerArgs(shutdown_timeout=-1)
    assert isinstance(_server_parser("x", ""), argparse.ArgumentParser)


def test_served_model_name_defaults_to_the_directory_name():
    from moeserve.models.default_model import default_model_path
    from moeserve.server.tokenizer_manager import default_served_name

    assert default_served_name(default_model_path()) == "default"  # not its cache path
    assert default_served_name("/models/Qwen3-30B-A3B/") == "Qwen3-30B-A3B"
