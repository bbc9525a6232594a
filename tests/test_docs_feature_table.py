"""The README's feature table against the code and against docs/serving.md's "Several GPUs: what has run".

Every flag the table names for a feature that is there exists in `moeserve serve --help` (and, given with a value,
parses); a flag with a value in a "not there" row is refused. Each row about several GPUs says what the status
table of docs/serving.md says for the same pieces (SAME_PIECES below), and every piece of that table has its row.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from tests.serve_commands import ROOT, parse_serve

STATUSES = ("works", "CPU ranks only", "not there")
# README feature (the start of its first cell) -> the pieces of docs/serving.md's table (the start of their first
# cell) it stands for. A piece with "run on GPUs" other than "no" is "works"; written "no" is "not there"; else
# "CPU ranks only".
SAME_PIECES = {
    "DP attention": ["NCCL process groups, DP attention"],
    "EP dispatch": ["allgather, all2all normal and low_latency dispatch"],
    "Two-batch overlap (on 2 GPUs": ["two-batch overlap"],
    "Two-batch overlap decided per step": ["two-batch overlap decided per step"],
    "Dense MLPs per DP rank": ["dense MLPs per DP rank"],
    "DP LM head": ["DP LM head"],
    "Decode CUDA graphs with several DP groups": ["static-shape decode with several DP groups",
                                                  "decode CUDA graphs with several DP groups", "`--cuda-graph-bs`"],
    "Tensor-parallel MoE": ["tensor-parallel MoE"],
    "Several nodes": ["several nodes"],
    "PD disaggregation on two GPUs": ["Mooncake over RDMA, PD on two GPUs"],
    "Speculative decoding with DeepSeek's MTP layer on one GPU": ["speculative rounds in CUDA graphs"],
    "Speculative decoding with attention TP": ["PD with speculative decoding"],
    "Hierarchical KV cache": ["host-tier copies on a side stream"],
    "FP8 on several GPUs": ["FP8 on several GPUs, online EPLB on several GPUs", "online EPLB with FP8 experts"],
    "Structured outputs": ["structured outputs' token mask on CUDA"],
    "Watchdog": ["`--watchdog-timeout`"],
    "DeepEP": ["DeepEP"],
    "Piecewise CUDA graphs with several DP groups": ["piecewise CUDA graphs for prefill/mixed steps"],
    "Two-batch overlap inside captured decode steps": ["two-batch overlap inside a captured decode graph"],
    "Low-latency dispatch whose bytes scale": ["symm dispatch"],
}


def table_rows(text: str, after: str) -> list[list[str]]:
    """The cells of the first Markdown table after the line that starts with `after` (header and rule dropped)."""
    lines = text[text.index(after):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip()[1:-1])])  # \| is no border
    return rows


def readme_features() -> list[tuple[str, list[str], str]]:
    """(feature, the flags cell's code spans, status) of every row of the README's feature table."""
    rows = table_rows((ROOT / "README.md").read_text(encoding="utf-8"), "<!-- feature table")
    assert len(rows) >= 20, "the README's feature table is gone or cut short"
    return [(feature, re.findall(r"`([^`]+)`", flags), status) for feature, flags, status in rows]


def serving_pieces() -> dict[str, str]:
    """docs/serving.md's "Several GPUs: what has run": piece -> its status in the README's words."""
    rows = table_rows((ROOT / "docs/serving.md").read_text(encoding="utf-8"), "## Several GPUs: what has run")
    assert len(rows) >= 10, "docs/serving.md's multi-GPU status table is gone or cut short"
    pieces = {}
    for piece, written, _tested_on_cpu, run_on_gpus in rows:
        if written.startswith("no"):
            pieces[piece] = "not there"
        elif run_on_gpus.startswith("no"):
            pieces[piece] = "CPU ranks only"
        else:
            pieces[piece] = "works"
    return pieces


def pieces_named(pieces: dict[str, str], start: str) -> list[str]:
    """The piece whose cell is `start`, else those that begin with it (exactly one)."""
    if start in pieces:
        return [start]
    found = [p for p in pieces if p.startswith(start)]
    assert len(found) == 1, f"docs/serving.md: {len(found)} pieces begin with {start!r}: {found}"
    return found


@pytest.fixture(scope="module")
def serve_help() -> str:
    out = subprocess.run([sys.executable, "-m", "moeserve.cli", "serve", "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_statuses_are_the_tables_three():
    bad = [(feature, status) for feature, _, status in readme_features() if status not in STATUSES]
    assert not bad, f"status must be one of {STATUSES}: {bad}"


def test_every_flag_of_a_feature_that_is_there_exists(serve_help):
    listed = set(re.findall(r"--[a-z][a-z0-9-]*", serve_help))
    for feature, spans, status in readme_features():
        for span in (s for s in spans if s.startswith("--")):
            words = shlex.split(span)
            if status == "not there":
                if len(words) > 1:  # a value moeserve has no code for: refused by name
                    with pytest.raises(ValueError):
                        parse_serve(words)
                else:
                    assert words[0] not in listed, (
                        f"{feature}: {words[0]} is a flag now, yet the row says not there: update the README's "
                        "feature table (and the recipe that says 'not in this build yet')")
                continue
            assert words[0] in listed, f"{feature}: `moeserve serve --help` has no {words[0]}"
            if len(words) > 1:
                parse_serve(words)


def test_multi_gpu_rows_say_what_servings_status_table_says():
    pieces = serving_pieces()
    features = readme_features()
    covered = set()
    for start, piece_starts in SAME_PIECES.items():
        rows = [(feature, status) for feature, _, status in features if feature.startswith(start)]
        assert len(rows) == 1, f"README's feature table: {len(rows)} rows begin with {start!r}"
        feature, status = rows[0]
        for piece in (p for s in piece_starts for p in pieces_named(pieces, s)):
            covered.add(piece)
            assert status == pieces[piece], (
                f"README says {feature!r} {status}; docs/serving.md says {piece!r} {pieces[piece]}")
    missing = set(pieces) - covered
    assert not missing, f"docs/serving.md's pieces with no row in the README's feature table: {sorted(missing)}"
