"""DP attention with the hierarchical cache: 2 CPU ranks in 2 DP groups, each group's scheduler with its own host
pool. Two-turn conversations whose histories do not fit a group's 64-token device pool give the single-rank
tokens (hierarchy off), and both groups moved pages to their host tier."""

from __future__ import annotations

import pytest

from moeserve.rank.sampling_params import SamplingParams
from tests.rank.inprocess import InProcessEngine
from tests.rank.test_hicache_engine import _first_turns, _seconds

pytestmark = pytest.mark.slow

GREEDY = dict(max_new_tokens=5, temperature=0.0, ignore_eos=True)


def test_each_dp_group_has_its_own_host_tier(tiny_checkpoint):
    from moeserve.server.engine import Engine

    path = tiny_checkpoint("v3_q_lora")
    firsts = _first_turns(31, 6)
    ref = InProcessEngine(model_path=path, dtype="float32", page_size=2)
    want_one = ref.run(firsts, SamplingParams(**GREEDY))
    seconds = _seconds(firsts, want_one, 5)
    want_two = ref.run(seconds, SamplingParams(**GREEDY))
    eng = Engine(model_path=path, skip_tokenizer_init=True, dtype="float32", log_level="warning", tp_size=2,
                 dp_size=2, enable_dp_attention=True, moe_a2a_backend="all2all", page_size=2, max_total_tokens=64,
                 enable_hierarchical_cache=True, hicache_ratio=8.0, hicache_write_policy="write_back")
    try:
        got_one = eng.generate(input_ids=firsts, sampling_params=GREEDY)
        got_two = eng.generate(input_ids=seconds, sampling_params=GREEDY)
        assert [o["output_ids"] for o in got_one + got_two] == [w["output_ids"] for w in want_one + want_two]
        assert all("host" in o["meta_info"]["cached_tokens_details"] for o in got_two)
        loads = eng.get_load()
        assert len(loads) == 2 and all(x.hicache["host_total_tokens"] == 8 * 64 for x in loads)
        assert all(x.hicache["bytes_to_host"] > 0 for x in loads)  # both groups evicted to their own host tier
    finally:
        eng.shutdown()
