"""SGLang's speculative-decoding flags (--speculative-*): NEXTN and EAGLE draft with DeepSeek's MTP layer, a chain
(top-k 1) of num_steps tokens verified as num_steps + 1; the rest refused by name. The draft/verify loop is in the
build (args.SPECULATIVE_LOOP_READY; moeserve/rank/speculative/)."""

from __future__ import annotations

import argparse

import pytest

import moeserve.args
from moeserve.args import REFUSED_SPECULATIVE, ServerArgs


def parse(argv: list[str]) -> ServerArgs:
    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))


@pytest.fixture
def loop_ready(monkeypatch):
    monkeypatch.setattr(moeserve.args, "SPECULATIVE_LOOP_READY", True)


def test_accepted_now_that_the_loop_is_in_the_build():
    assert moeserve.args.SPECULATIVE_LOOP_READY
    for algorithm in ("NEXTN", "EAGLE"):
        assert parse(["--speculative-algorithm", algorithm]).speculative_num_steps == 3
    with pytest.raises(ValueError, match="--speculative-eagle-topk 2: tree drafting"):
        ServerArgs(speculative_algorithm="NEXTN", speculative_num_steps=2, speculative_eagle_topk=2)


def test_sglang_commands_and_defaults(loop_ready):
    # the LMSYS MTP blog's flags, and SGLang's choice for DeepSeek when none is given
    args = parse(["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "1", "--speculative-eagle-topk", "1",
                  "--speculative-num-draft-tokens", "2"])
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (1, 1, 2)
    args = parse(["--speculative-algorithm", "NEXTN"])
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (3, 1, 4)
    args = ServerArgs(speculative_algorithm="NEXTN", speculative_num_steps=2, speculative_draft_model_path="/x")
    assert (args.speculative_eagle_topk, args.speculative_num_draft_tokens, args.speculative_draft_model_path) == (
        1, 3, "/x")


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(speculative_num_steps=3, speculative_eagle_topk=4), "--speculative-eagle-topk 4: tree drafting"),
    (dict(speculative_num_steps=3, speculative_num_draft_tokens=8),
     r"--speculative-num-draft-tokens 8: .* --speculative-num-steps \+ 1 = 4"),
    (dict(speculative_num_draft_tokens=4), "need --speculative-num-steps too"),
    (dict(speculative_eagle_topk=1), "need --speculative-num-steps too"),
    (dict(speculative_num_steps=0), "--speculative-num-steps must be >= 1"),
])
def test_refused_values(loop_ready, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(speculative_algorithm="NEXTN", **kwargs)


@pytest.mark.parametrize("flag", ["--speculative-num-steps", "--speculative-eagle-topk",
                                  "--speculative-num-draft-tokens", "--speculative-draft-model-path"])
def test_flags_without_an_algorithm_are_refused(flag):
    with pytest.raises(ValueError, match=f"{flag} takes effect only with --speculative-algorithm"):
        parse([flag, "/x" if flag.endswith("path") else "2"])


@pytest.mark.parametrize("algorithm", sorted(REFUSED_SPECULATIVE))
def test_other_algorithms_refused_by_name(algorithm):
    with pytest.raises(argparse.ArgumentError, match=f"{algorithm}: .*NEXTN"):
        parse(["--speculative-algorithm", algorithm])
    with pytest.raises(ValueError, match=f"--speculative-algorithm {algorithm}: .*NEXTN"):
        ServerArgs(speculative_algorithm=algorithm)
