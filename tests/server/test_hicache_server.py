"""The hierarchical KV cache in a running Engine (worker process): two-turn conversations whose histories do not
fit the device pool, greedy tokens equal to transformers' own model, the second turns' meta_info split by tier,
the host tier in /get_load, pages written to a file storage tier; and its /metrics counters from responses and
loads."""

from __future__ import annotations

import json
import random
import time

from prometheus_client.parser import text_string_to_metric_families

import moeserve
from moeserve.rank.io_struct import LoadOut
from moeserve.server.http.metrics import Metrics
from tests.checkpoints import VOCAB, build_checkpoint
from tests.rank.test_generation import hf_greedy

NEW = 5


def test_engine_second_turns_from_host_match_transformers(tmp_path):
    path = build_checkpoint("v3_q_lora", tmp_path / "v3")
    rng = random.Random(61)
    system = [rng.randrange(2, VOCAB) for _ in range(8)]
    firsts = [system + [rng.randrange(2, VOCAB) for _ in range(rng.randrange(20, 30))] for _ in range(5)]
    params = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    eng = moeserve.Engine(model_path=path, skip_tokenizer_init=True, page_size=2, max_total_tokens=64,
                          enable_hierarchical_cache=True, hicache_ratio=6.0, hicache_write_policy="write_back",
                          hicache_storage_backend="file",
                          hicache_storage_backend_extra_config=json.dumps({"path": str(tmp_path / "kv")}))
    try:
        one = [eng.generate(input_ids=p, sampling_params=params) for p in firsts]
        assert [o["output_ids"] for o in one] == hf_greedy("v3_q_lora", firsts, NEW)
        seconds = [p + o["output_ids"] + [rng.randrange(2, VOCAB) for _ in range(4)]
                   for p, o in zip(firsts, one, strict=True)]
        two = [eng.generate(input_ids=p, sampling_params=params) for p in seconds]
        assert [o["output_ids"] for o in two] == hf_greedy("v3_q_lora", seconds, NEW)
        details = [o["meta_info"]["cached_tokens_details"] for o in two]
        assert all(set(d) == {"device", "host", "storage"} for d in details)
        assert all(sum(d.values()) == o["meta_info"]["cached_tokens"] for d, o in zip(details, two, strict=True))
        assert sum(d["host"] for d in details) >= 4 * 20  # the histories were evicted to host and came back
        load = eng.get_load()
        tier = (load[0] if isinstance(load, list) else load).hicache
        assert tier["host_total_tokens"] == 6 * 64 and tier["bytes_to_device"] > 0 and tier["bytes_to_host"] > 0
        assert tier["bytes_to_storage"] > 0
        deadline = time.monotonic() + 30  # the storage tier's writer thread puts the pages after the copy
        while len(list((tmp_path / "kv").rglob("*.kvpage"))) < 4 * 20 // 2:
            assert time.monotonic() < deadline, "the storage tier's pages never reached the files"
            time.sleep(0.05)
    finally:
        eng.shutdown()


def _samples(text: bytes) -> dict[tuple, float]:
    return {(s.name, s.labels.get("tier") or s.labels.get("direction")): s.value
            for f in text_string_to_metric_families(text.decode()) for s in f.samples
            if s.name.startswith("moeserve:hicache")}


def _load(report: dict | None, dp_rank: int = 0) -> LoadOut:
    return LoadOut(dp_rank, 0, 0, 0, 0, 100, 0, hicache=report)


def test_metrics_count_tiers_bytes_and_load_back_time():
    m = Metrics("m")
    m.on_finish({"prompt_tokens": 30, "cached_tokens": 24, "cached_tokens_details": {"device": 4, "host": 20}}, 0.1)
    m.on_finish({"prompt_tokens": 30, "cached_tokens": 8, "cached_tokens_details": {"device": 8, "host": 0}}, 0.1)
    report = {"host_used_tokens": 40, "host_total_tokens": 200, "bytes_to_host": 1000, "bytes_to_device": 300,
              "load_back_seconds": 0.5}
    s = _samples(m.render([_load(report), _load(dict(report, host_used_tokens=2), 1)]))
    assert s[("moeserve:hicache_hit_tokens_total", "device")] == 12
    assert s[("moeserve:hicache_hit_tokens_total", "host")] == 20
    assert s[("moeserve:hicache_bytes_total", "to_host")] == 2000
    assert s[("moeserve:hicache_bytes_total", "to_device")] == 600
    assert s[("moeserve:hicache_load_back_seconds_total", None)] == 1.0
    assert s[("moeserve:hicache_storage_pages_dropped_total", None)] == 0
    assert s[("moeserve:hicache_host_tokens", None)] == 42
    s = _samples(m.render([_load(dict(report, bytes_to_device=400)), _load(report, 1)]))  # growth only
    assert s[("moeserve:hicache_bytes_total", "to_device")] == 700
    s = _samples(m.render([_load(dict(report, storage_pages_dropped=3)), _load(dict(report, storage_pages_dropped=2), 1)]))
    assert s[("moeserve:hicache_storage_pages_dropped_total", None)] == 5
    assert s[("moeserve:hicache_bytes_total", "to_host")] == 2000
