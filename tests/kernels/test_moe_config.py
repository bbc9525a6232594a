"""The tuned launch tables: the nearest row count's entry, the default without a file."""

from __future__ import annotations

import json

import torch

from moeserve.kernels import moe_config


def test_nearest_entry_and_default(tmp_path, monkeypatch):
    monkeypatch.setattr(moe_config, "CONFIG_DIR", tmp_path)
    moe_config._lookup.cache_clear()
    moe_config._load.cache_clear()
    small = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4)
    path = moe_config.config_file("moe_gemm", 8, 64, 32, torch.bfloat16, moe_config.device_name())
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"6": small, "4096": {"backend": "torch"}}))
    assert moe_config.get_config("moe_gemm", 100, 8, 64, 32, torch.bfloat16) == small
    assert moe_config.get_config("moe_gemm", 3000, 8, 64, 32, torch.bfloat16) == {"backend": "torch"}
    got = moe_config.get_config("moe_gemm", 100, 8, 64, 32, torch.float32)  # no table for fp32: the default
    assert got == moe_config.default_config(100, 8)
    got["BLOCK_M"] = 1  # callers get a copy: the cached entry stays
    assert moe_config.get_config("moe_gemm", 100, 8, 64, 32, torch.float32)["BLOCK_M"] != 1
    moe_config._lookup.cache_clear()


def test_shipped_tables_parse():
    for path in moe_config.CONFIG_DIR.glob("*/*.json"):
        table = json.loads(path.read_text())
        assert table and all(int(m) > 0 for m in table), path
        need = {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}
        if not path.parent.name.startswith("fp8_"):  # the FP8 kernels' K step is the 128-wide scale block
            need.add("BLOCK_K")
        for cfg in table.values():
            assert cfg == {"backend": "torch"} or need <= set(cfg), path
