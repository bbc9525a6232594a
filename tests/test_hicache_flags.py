"""SGLang's hierarchical-cache flags: their defaults, and each combination not done refused by its name."""

from __future__ import annotations

import argparse

import pytest

from moeserve.args import ServerArgs


def parse(argv: list[str]) -> ServerArgs:
    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))


def test_sglang_defaults_and_values():
    args = parse(["--enable-hierarchical-cache"])
    assert (args.hicache_ratio, args.hicache_size, args.hicache_write_policy) == (2.0, 0, "write_through")
    assert args.hicache_storage_backend is None and args.hicache_storage_prefetch_policy == "best_effort"
    args = parse(["--enable-hierarchical-cache", "--hicache-ratio", "3", "--hicache-size", "4",
                  "--hicache-write-policy", "write_back", "--hicache-storage-backend", "file",
                  "--hicache-storage-prefetch-policy", "timeout",
                  "--hicache-storage-backend-extra-config", '{"path": "/tmp/kv"}'])
    assert args.hicache_ratio == 3.0 and args.hicache_size == 4 and args.hicache_storage_backend == "file"


@pytest.mark.parametrize(("argv", "named"), [
    (["--hicache-ratio", "3"], "--hicache-ratio takes effect only with --enable-hierarchical-cache"),
    (["--hicache-storage-backend", "file"], "--hicache-storage-backend takes effect only with"),
    (["--enable-hierarchical-cache", "--disable-radix-cache"], "--disable-radix-cache"),
    (["--enable-hierarchical-cache", "--hicache-storage-prefetch-policy", "timeout"],
     "--hicache-storage-prefetch-policy takes effect only with --hicache-storage-backend"),
    (["--enable-hierarchical-cache", "--disaggregation-mode", "decode"], "decode server keeps no prefix cache"),
    (["--enable-hierarchical-cache", "--hicache-ratio", "0"], "--hicache-ratio must be > 0"),
    (["--enable-hierarchical-cache", "--hicache-storage-backend", "file", "--tp-size", "2"],
     "--hicache-storage-backend with an attention-TP group of 2 ranks"),
    (["--enable-hierarchical-cache", "--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
      "{path: x}"], "not JSON"),
])
def test_refused_by_name(argv, named):
    with pytest.raises(ValueError, match=named):
        parse(argv)


def test_unknown_choices_are_usage_errors():
    for argv in (["--hicache-write-policy", "write_around"], ["--hicache-storage-backend", "hf3fs"]):
        with pytest.raises(argparse.ArgumentError):
            parse(["--enable-hierarchical-cache", *argv])
