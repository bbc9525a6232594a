"""`python -m moeserve.bench.offline` on the embedded default model: one JSON line with consistent token counts."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_offline_bench_two_ranks(tmp_path, capsys):
    from moeserve.bench.offline import main

    out = tmp_path / "r.jsonl"
    assert main(["--tp-size", "2", "--enable-dp-attention", "--dp-size", "2", "--moe-a2a-backend", "all2all",
                 "--num-prompts", "4", "--input-len", "8", "--output-len", "3", "--warmup-prompts", "0",
                 "--log-level", "warning", "--result-file", str(out)]) == 0
    (r,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert (r["tp_size"], r["dp_size"], r["moe_a2a_backend"]) == (2, 2, "all2all")
    assert r["input_tokens"] == 32 and r["output_tokens"] == 12
    assert r["total_tok_s"] == pytest.approx(r["input_tok_s"] + r["output_tok_s"])
    assert all(n > 0 for n in r["groups_cached_tokens"])  # both attention groups got prompts
    assert "tp 2 dp 2 all2all/auto: 4 prompts" in capsys.readouterr().out


def test_offline_bench_with_a_json_schema(tmp_path, capsys):
    from moeserve.bench.offline import main

    out = tmp_path / "r.jsonl"
    schema = '{"type": "array", "items": {"type": "integer"}, "minItems": 20}'  # longer than the output
    assert main(["--num-prompts", "2", "--input-len", "8", "--output-len", "6", "--warmup-prompts", "0",
                 "--log-level", "warning", "--json-schema", schema, "--result-file", str(out)]) == 0
    (r,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert r["json_schema"] and r["output_tokens"] == 12
    assert "JSON schema" in capsys.readouterr().out
