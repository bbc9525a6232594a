"""`moeserve bench kv-transfer` on a small pool: every kind runs, and the receiver's pages are verified."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("mooncake.engine", reason="Mooncake is not installed (make install brings it)")


def test_kv_transfer_bench_small(tmp_path):
    from moeserve.bench.kv_transfer import main

    out = tmp_path / "r.jsonl"
    assert main(["--mib", "1", "--iters", "1", "--warmup", "0", "--layers", "3", "--run-tokens", "4",
                 "--kinds", "mooncake", "raw-mooncake", "zmq", "--result-file", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["mooncake", "raw-mooncake", "zmq"]
    assert all(r["verified"] and r["gb_s"] > 0 for r in rows)
    assert rows[0]["ranges"] == rows[2]["ranges"] == 3 * round(2**20 / (4 * 3 * 1152))  # runs x layers, one write
