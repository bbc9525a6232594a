"""The `moeserve` command line: SGLang's flag aliases, help that says each default once, and `generate`'s own flags."""

from __future__ import annotations

import argparse
import dataclasses
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
    from moeserve.server.startup import default_served_name

    assert default_served_name(default_model_path()) == "default"  # not its cache path
    assert default_served_name("/models/Qwen3-30B-A3B/") == "Qwen3-30B-A3B"


def test_a_layout_the_model_cannot_run_fails_before_any_process_starts(tmp_path):
    import json
    import subprocess
    import sys
    import time

    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 256,
              "hidden_size": 80, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 5, "num_key_value_heads": 5, "head_dim": 16, "num_experts": 8,
              "num_experts_per_tok": 2, "max_position_embeddings": 512, "bos_token_id": 0, "eos_token_id": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "moeserve.cli", "serve", "--model-path", str(tmp_path),
                        "--tp-size", "2"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "5 attention heads" in r.stderr and "--tp-size 2" in r.stderr
    assert "Traceback" not in r.stderr and "rank" not in r.stdout
    assert time.monotonic() - start < 30


def test_check_model_fits_names_the_flags():
    from moeserve.core.model_config import ModelConfig
    from moeserve.models.default_model import default_model_path
    from moeserve.server.startup import check_model_fits

    config = ModelConfig.from_pretrained(default_model_path())  # 16 experts, 4 MLA heads
    check_model_fits(ServerArgs(tp_size=2, ep_size=2), config)
    with pytest.raises(ValueError, match="4 attention heads.*--tp-size 3"):
        check_model_fits(ServerArgs(tp_size=3), config)
    dp = dict(tp_size=3, dp_size=3, enable_dp_attention=True)  # one rank per attention group
    with pytest.raises(ValueError, match="16 physical experts .*--ep-size 3"):
        check_model_fits(ServerArgs(**dp), config)
    check_model_fits(ServerArgs(**dp, ep_num_redundant_experts=2), config)


@pytest.mark.parametrize("kwargs", [dict(disaggregation_bootstrap_port=9000),
                                    dict(disaggregation_transfer_backend="zmq"),
                                    dict(disaggregation_heartbeat_interval=2.0)])
def test_pd_flags_need_a_pd_mode(kwargs):
    """A PD flag on a colocated server would do nothing: it is refused, naming the flag."""
    flag = "--" + next(iter(kwargs)).replace("_", "-")
    with pytest.raises(ValueError, match=f"{flag} takes effect only with --disaggregation-mode"):
        ServerArgs(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(disaggregation_transfer_backend="tcp"), "choose one of mooncake, zmq"),
    (dict(disaggregation_heartbeat_timeout=0.5), "must exceed --disaggregation-heartbeat-interval"),
    (dict(disaggregation_transfer_timeout=0), "must be > 0 seconds"),
    (dict(disaggregation_debug_failure_prob=1.5), r"must be in \[0, 1\]"),
    (dict(disaggregation_transfer_backend="zmq", disaggregation_ib_device="mlx5_0"), "mooncake only"),
])
def test_pd_flags_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServerArgs(disaggregation_mode="prefill", **kwargs)


def test_pd_sides_take_attention_tp():
    """Each side has its own parallelism, attention TP included (the PD rooms run on every rank of the group)."""
    for mode in ("prefill", "decode"):
        assert ServerArgs(disaggregation_mode=mode, tp_size=2).attn_tp_size == 2
    assert ServerArgs(disaggregation_mode="decode", tp_size=2, dp_size=2, enable_dp_attention=True)


def test_mooncake_missing_names_the_zmq_backend(monkeypatch):
    """Asked for Mooncake where it cannot load, a server fails at start saying what to install and which flag to use
    instead."""
    import builtins

    from moeserve.disagg.transfer import registry

    real_import = builtins.__import__

    def no_mooncake(name, *args, **kwargs):
        if "mooncake" in name:
            raise ImportError("libibverbs.so.1: cannot open shared object file")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mooncake)
    monkeypatch.delitem(__import__("sys").modules, "moeserve.disagg.transfer.mooncake", raising=False)
    with pytest.raises(ValueError, match="--disaggregation-transfer-backend zmq"):
        registry.backend_class("mooncake")
    assert registry.backend_class("zmq").name == "zmq"


def test_every_flag_has_exactly_one_help_topic():
    from collections import Counter

    from moeserve.args import HELP_GROUPS

    fields = {f.name for f in dataclasses.fields(ServerArgs)}
    listed = Counter(name for names in HELP_GROUPS.values() for name in names)
    missing = sorted(fields - set(listed))
    assert not missing, f"flags without a --help topic: add each to one of args.py's HELP_GROUPS: {missing}"
    twice = sorted(name for name, n in listed.items() if n > 1)
    assert not twice, f"flags in more than one of args.py's HELP_GROUPS: {twice}"
    unknown = sorted(set(listed) - fields)
    assert not unknown, f"HELP_GROUPS names that are not ServerArgs fields: {unknown}"


def test_serve_help_is_grouped_by_topic(capsys):
    from moeserve.args import HELP_GROUPS

    with pytest.raises(SystemExit):
        _server_parser("moeserve serve", "").parse_args(["--help"])
    text = capsys.readouterr().out
    headings = [line[:-1] for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headings == ["options", *(topic for topic, names in HELP_GROUPS.items() if names)], headings
    section = text[text.index("\ndebugging:"):]
    assert "--eplb-debug-fail" in section and "--disaggregation-debug-failure-prob" in section
    assert "--eplb-debug-fail" not in text[:text.index("\ndebugging:")]
    port = text[text.index("\nserver:"):]
    assert port.index("--port") < port.index("\n\n")  # --port sits in the server section


@pytest.mark.parametrize("kind", ["serving", "pd"])
def test_bench_help_says_each_default_once(kind):
    import importlib

    parser = importlib.import_module(f"moeserve.bench.{kind}").build_parser()
    text = parser.format_help()
    assert "(default: None)" not in text
    assert not re.search(r"default[^)]*\)\s*\(default:", text), "a default printed twice"
    assert re.search(r"\(default: \d+", text)  # a plain default is still said
