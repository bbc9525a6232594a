"""`moeserve bench one-batch`: runs on the embedded model beside transformers and reports medians of its rounds."""

from __future__ import annotations

import json
from pathlib import Path

from moeserve.bench.one_batch import main


def test_one_batch_with_transformers(tmp_path, capsys):
    result = tmp_path / "r.jsonl"
    assert main(["--batch-size", "1", "3", "--input-len", "9", "--output-len", "5", "--repeat", "2",
                 "--compare-transformers", "--result-file", str(result)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("batch")]
    assert len(lines) == 2 and all("speedup prefill" in ln for ln in lines)
    rows = [json.loads(ln) for ln in result.read_text().splitlines()]
    assert [r["batch_size"] for r in rows] == [1, 3]
    for r in rows:
        for system in ("moeserve", "transformers"):
            m = r[system]
            assert m["rounds"] == 2 and len(m["decode_tok_s_all"]) == 2
            assert m["decode_tok_s"] > 0 and m["prefill_tok_s"] > 0
            assert min(m["decode_tok_s_all"]) <= m["decode_tok_s"] <= max(m["decode_tok_s_all"])
        assert r["decode_speedup"] == r["moeserve"]["decode_tok_s"] / r["transformers"]["decode_tok_s"]
        t = r["transformers"]["tokens"]
        assert t["requests"] == r["batch_size"] and (t["equal"] == t["requests"] or t["near_ties_only"])


def test_dummy_weights_are_the_same_in_both(capsys):
    """--load-format dummy: transformers runs moeserve's dummy weights, so the greedy tokens agree."""
    config = str(Path(__file__).parents[2] / "benchmarks" / "configs" / "deepseek-v3-tiny-kv512")
    assert main(["--model-path", config, "--load-format", "dummy", "--batch-size", "3", "--input-len", "6",
                 "--output-len", "6", "--compare-transformers"]) == 0
    out = capsys.readouterr().out
    assert "greedy tokens: 3/3 requests equal to transformers'" in out, out
