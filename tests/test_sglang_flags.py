"""SGLang's large-EP launch flags (its 96-GPU PD commands): each one works or is refused by its name, with what to
use instead. The commands themselves start and serve in tests/disagg/test_sglang_launch.py."""

from __future__ import annotations

import argparse
import dataclasses
import random

import pytest

from moeserve.args import ServerArgs
from moeserve.ep.registry import BACKENDS, REFUSED_BACKENDS
from moeserve.rank.cuda_graph_runner import batch_buckets


def parse(argv: list[str]) -> ServerArgs:
    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))


@pytest.mark.parametrize(("argv", "flag", "instead"), [
    (["--enable-deepep-moe"], "--enable-deepep-moe", "--moe-a2a-backend all2all"),
    (["--tp-size", "2", "--ep-size", "2", "--enable-deepep-moe", "--deepep-mode", "low_latency"],
     "--enable-deepep-moe", "--moe-a2a-backend all2all"),
    (["--deepep-config", "deepep.json"], "--deepep-config", "--ep-max-tokens-per-rank"),
    (["--moe-dense-tp-size", "2"], "--moe-dense-tp-size 2", "pass 1"),
    (["--enable-dp-lm-head"], "--enable-dp-lm-head", "--enable-dp-attention"),
    (["--enable-deepep-moe", "--moe-a2a-backend", "allgather"], "--enable-deepep-moe", "pass one of them"),
    (["--watchdog-timeout", "0"], "--watchdog-timeout", "> 0"),
    (["--cuda-graph-bs", "0", "8"], "--cuda-graph-bs", ">= 1"),
])
def test_refused_flags_name_themselves_and_what_to_use(argv, flag, instead):
    if "deepep" in BACKENDS and "deepep" in " ".join(argv):
        pytest.skip("a DeepEP dispatcher is registered here")
    with pytest.raises(ValueError) as e:
        parse(argv)
    assert flag in str(e.value) and instead in str(e.value)


def test_deepep_backend_is_refused_by_argparse_with_the_reason():
    if "deepep" not in REFUSED_BACKENDS:
        pytest.skip("a DeepEP dispatcher is registered here")
    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    with pytest.raises(argparse.ArgumentError) as e:
        parser.parse_args(["--moe-a2a-backend", "deepep"])
    assert "--moe-a2a-backend" in str(e.value) and "all2all" in str(e.value)
    with pytest.raises(ValueError, match="--moe-a2a-backend deepep: .*all2all"):  # the Engine's kwargs too
        ServerArgs(moe_a2a_backend="deepep")


def test_accepted_flags_take_sglang_values():
    rng = random.Random(49)
    sizes = rng.sample(range(1, 300), 6)
    args = parse(["--trust-remote-code", "--moe-dense-tp-size", "1", "--tp-size", "2", "--dp-size", "2",
                  "--enable-dp-attention", "--enable-dp-lm-head", "--decode-log-interval", "1",
                  "--watchdog-timeout", "1000000", "--dist-timeout", "3600", "--cuda-graph-bs", *map(str, sizes)])
    assert args.trust_remote_code and args.moe_dense_tp_size == 1 and args.enable_dp_lm_head
    help_text = dataclasses.fields(ServerArgs)[[f.name for f in dataclasses.fields(ServerArgs)].index(
        "trust_remote_code")].metadata["help"]
    assert "moeserve runs no code from a checkpoint" in help_text
    assert (args.decode_log_interval, args.watchdog_timeout, args.dist_timeout) == (1, 1e6, 3600)
    assert args.cuda_graph_bs == sorted(sizes) and args.cuda_graph_max_bs == max(sizes)


def test_cuda_graph_bs_is_the_captured_list():
    rng = random.Random(7)
    sizes = sorted(rng.sample(range(1, 64), 5))
    cap = rng.choice(sizes)
    assert batch_buckets(cap, sizes) == [s for s in sizes if s <= cap]  # sizes above the request cap are dropped
    assert batch_buckets(1, [2, 4]) == [1]  # every size above the cap: the cap itself
    assert batch_buckets(20) == [1, 2, 4, 8, 12, 16, 20]  # without the list: moeserve's buckets
