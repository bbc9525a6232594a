"""`moeserve eplb` command line: every subcommand runs end to end and returns 0."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moeserve.eplb.tools.cli import build_parser, main


@pytest.fixture(scope="module")
def dump(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("eplb") / "w.pt"
    argv = [
        "synth",
        "--dist",
        "lognormal",
        "--layers",
        "3",
        "--experts",
        "16",
        "--steps",
        "24",
        "--tokens-per-step",
        "256",
        "--topk",
        "2",
        "--groups",
        "4",
        "--out",
        str(path),
    ]
    assert main(argv) == 0
    return str(path)


def test_synth_analyze_simulate(dump: str, tmp_path, capsys) -> None:
    assert (
        main(
            [
                "analyze",
                dump,
                "--out",
                str(tmp_path / "a"),
                "--nodes",
                "2",
                "--gpus-per-node",
                "2",
                "--redundant",
                "4",
            ]
        )
        == 0
    )
    assert (tmp_path / "a" / "summary.txt").exists()
    assert (
        main(
            [
                "simulate",
                dump,
                "--out",
                str(tmp_path / "s"),
                "--nodes",
                "1,2",
                "--gpus-per-node",
                "2",
                "--redundant",
                "0,4",
                "--tokens-per-gpu",
                "32,128",
                "--holdout-chunks",
                "3",
                "--quiet",
            ]
        )
        == 0
    )
    data = json.loads((tmp_path / "s" / "simulate.json").read_text())
    assert data["settings"]["topk"] == 2 and data["settings"]["num_groups"] == 4  # read from the dump's meta
    assert len(data["rows"]) == 8
    out = capsys.readouterr().out
    assert "EPLB held" in out and "balancedness" in out


def test_plan_and_calibration(tmp_path, capsys) -> None:
    path = tmp_path / "plan.json"
    assert main(["plan", "--num-gpus", "72", "--balancedness", "0.9", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert [p["deployment"]["phase"] for p in data["plans"]] == ["decode", "prefill"]
    assert (
        main(
            [
                "plan",
                "--model",
                "deepseek-v2-lite",
                "--gpu",
                "h200",
                "--gpu-rdma-gbps",
                "100",
                "--num-gpus",
                "8",
                "--redundant",
                "0",
                "--phase",
                "decode",
                "--no-tbo",
                "--balancedness",
                "0.8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "tok/s per GPU" in out and "breakdown" in out
    assert main(["plan", "--calibration"]) == 0
    assert "SGLang decode" in capsys.readouterr().out


def test_user_errors_return_2(tmp_path, capsys) -> None:
    assert main(["analyze", str(tmp_path / "missing.pt"), "--out", str(tmp_path)]) == 2
    assert main(["plan", "--num-gpus", "72", "--redundant", "0", "--balancedness", "0.9"]) == 2
    assert "multiple of EP size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["simulate", "x.pt", "--out", "o", "--nodes", "a,b"])


def test_python_dash_m() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "moeserve.eplb.tools.cli", "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0 and "synth" in done.stdout
