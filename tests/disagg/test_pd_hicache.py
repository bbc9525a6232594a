"""PD with the hierarchical cache on the prefill server (in one process, zmq transfer): second turns whose
histories left prefill's small device pool are loaded back from its host tier, the tokens equal a colocated
engine's without the hierarchy, decode reports prefill's split by tier, and prefill's pages all come back."""

from __future__ import annotations

from moeserve.kvcache import HiRadixCache
from tests.checkpoints import build_checkpoint
from tests.disagg.pd_harness import PDPair
from tests.rank.inprocess import InProcessEngine
from tests.rank.test_hicache_engine import GREEDY, _first_turns, _seconds


def test_prefill_server_serves_second_turns_from_host(tmp_path):
    path = build_checkpoint("v3_q_lora", tmp_path / "v3")
    firsts = _first_turns(23, 5)
    ref = InProcessEngine(model_path=path, dtype="float32", page_size=2)
    want_one = ref.run(firsts, GREEDY)
    seconds = _seconds(firsts, want_one, 9)
    want_two = ref.run(seconds, GREEDY)
    del ref
    pair = PDPair(model_path=path, page_size=2, max_total_tokens=512,
                  prefill_kwargs=dict(max_total_tokens=96, max_running_requests=4, enable_hierarchical_cache=True,
                                      hicache_ratio=6.0, hicache_write_policy="write_back"))
    try:
        got_one = pair.run(firsts, GREEDY)
        got_two = pair.run(seconds, GREEDY)
        assert [g["output_ids"] for g in got_one + got_two] == [w["output_ids"] for w in want_one + want_two]
        details = [pair.decode.outs[rid][-1].cached_tokens_details for rid in pair.decode.outs
                   if pair.decode.outs[rid][-1].cached_tokens_details and
                   pair.decode.outs[rid][-1].cached_tokens_details["host"]]
        assert details, "no second turn was served from prefill's host tier"
        pair.step_until(pair.idle)
        cache = pair.prefill.scheduler.cache
        assert isinstance(cache, HiRadixCache) and cache.protected_size == 0
        assert pair.prefill.free_pages() == pair.prefill.scheduler.allocator.num_pages
        assert cache.host.allocator.num_free_pages == cache.host.num_pages  # flush_cache freed the host tier too
    finally:
        pair.close()
