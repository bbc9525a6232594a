"""`moeserve serve` command lines checked as moeserve takes them, without starting anything: the flags parsed and
validated by ServerArgs, the parallel layout checked against the model's shapes. For the docs' commands
(tests/test_docs_commands.py) and the deployment manifest (tests/test_deploy_manifest.py), whose model paths are
placeholders for checkpoints too large for CI: each is checked against a config of the same shapes."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from moeserve.args import ServerArgs

ROOT = Path(__file__).resolve().parents[1]
# A placeholder model directory's name (its part before a dash and a date or variant) -> a config of its shapes
MODEL_SHAPES = {
    "DeepSeek-V3": ROOT / "benchmarks/configs/deepseek-v3-4layer",  # V3's layer shapes, 256 experts top 8
    "DeepSeek-R1": ROOT / "benchmarks/configs/deepseek-v3-4layer",  # R1 has V3's architecture
    "DeepSeek-V2-Lite": ROOT / "benchmarks/configs/deepseek-v2-lite",
}


def parse_serve(argv: list[str]) -> ServerArgs:
    """ServerArgs from `moeserve serve`'s flags, as the command parses them; ValueError naming what is wrong."""
    parser = argparse.ArgumentParser(prog="moeserve serve", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    try:
        ns, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ValueError(str(e)) from e
    if unknown:
        raise ValueError(f"unknown flags: {' '.join(unknown)}")
    return ServerArgs.from_cli_args(ns)


def shapes_of(model_path: str) -> Path:
    """The config standing in for a placeholder checkpoint directory."""
    name = Path(model_path).name
    matches = [key for key in MODEL_SHAPES if name == key or name.startswith(key + "-")]
    if not matches:
        raise ValueError(f"no config of {model_path}'s shapes in MODEL_SHAPES")
    return MODEL_SHAPES[max(matches, key=len)]


def check_serve(argv: list[str]) -> ServerArgs:
    """parse_serve, then the layout checked against the model's shapes as `moeserve serve` checks it before it
    starts any process (attention heads over the attention group, physical experts over the EP ranks)."""
    from moeserve.server.startup import load_model_config

    args = parse_serve(argv)
    if args.model_path is not None:
        load_model_config(dataclasses.replace(args, model_path=str(shapes_of(args.model_path))))
    return args


def flag_groups(argv: list[str]) -> dict[str, list[str]]:
    """argv as {flag: its values}, in order (a flag's values are the words up to the next flag)."""
    groups: dict[str, list[str]] = {}
    flag = None
    for word in argv:
        if word.startswith("--"):
            flag, _, value = word.partition("=")
            groups[flag] = [value] if value else []
        else:
            assert flag is not None, f"{word!r} before any flag"
            groups[flag].append(word)
    return groups


def scaled(argv: list[str], overrides: list[str], drop: tuple[str, ...]) -> list[str]:
    """A GPU command at CPU scale: the flags in `drop` removed, those in `overrides` (flags and values) set."""
    groups = {f: v for f, v in flag_groups(argv).items() if f not in drop}
    groups.update(flag_groups(overrides))
    return [word for flag, values in groups.items() for word in (flag, *values)]
