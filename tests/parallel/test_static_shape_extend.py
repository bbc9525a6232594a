"""Static-shape extend (prefill and mixed) steps with several DP groups (moeserve/rank/static_extend.py), on CPU
ranks.

With --enable-static-shape-extend every group runs each extend step at one padded token count that all ranks agree
on through the step header (the largest group's, bucketed as the piecewise CUDA graphs are), an idle group too.
Greedy tokens of random prompts on 2 ranks (2 DP groups) and on 4 ranks (2 groups of 2), through all2all and its
low_latency mode (there with the decode steps padded too, --enable-static-shape-decode), must equal the
single-rank in-process run's (which test_generation ties to transformers) and, on 2 ranks, the same server's
without the flag: with both groups busy, with one group idle, with 1 request in one group beside 7 in the other,
with prompts chunked (--chunked-prefill-size) beside running decodes (mixed steps), and with prefix-cache hits.
The groups' step counts show the padded path ran, the same number of times in each group; afterwards every page
of the KV pool is free again.
"""

from __future__ import annotations

import random

import pytest

from moeserve.rank.sampling_params import SamplingParams
from tests.rank.inprocess import InProcessEngine

pytestmark = pytest.mark.slow

GREEDY = dict(max_new_tokens=6, temperature=0.0, ignore_eos=True)
DP2 = dict(tp_size=2, dp_size=2, enable_dp_attention=True, moe_a2a_backend="all2all")
# prompts longer than a chunk prefill in pieces, and chunks run beside the running decodes (MIXED steps)
CHUNKED = dict(chunked_prefill_size=16, enable_mixed_chunk=True)
_REF: dict[tuple, list[list[int]]] = {}


def _prompts(n: int = 8, seed: int = 492) -> list[list[int]]:
    from tests.checkpoints import VOCAB

    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


def _continued(prompts: list[list[int]], seed: int = 493) -> list[list[int]]:
    """The prompts with a few new tokens each: their first tokens hit the prefix cache."""
    from tests.checkpoints import VOCAB

    rng = random.Random(seed)
    return [p + [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 6))] for p in prompts]


def _single_rank(path: str, prompts: list[list[int]]) -> list[list[int]]:
    key = (path, *map(tuple, prompts))
    if key not in _REF:
        eng = InProcessEngine(model_path=path, dtype="float32")
        _REF[key] = [r["output_ids"] for r in eng.run(prompts, SamplingParams(**GREEDY))]
    return _REF[key]


def _engine(path: str, **kw):
    from moeserve.server.engine import Engine

    return Engine(model_path=path, skip_tokenizer_init=True, dtype="float32", log_level="warning", **CHUNKED, **kw)


def _static_steps(eng) -> list[int]:
    return [load.step_counts.get("static_extend", 0) for load in eng.get_load()]


def _ids(outs) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def _padded_in_both(eng, before: list[int]) -> list[int]:
    """The groups' padded extend steps now: some ran since `before`, as many in each group (an idle one too)."""
    after = _static_steps(eng)
    assert after[0] - before[0] == after[1] - before[1] > 0, (before, after)
    return after


# (ranks, dispatch mode, decode steps padded too)
@pytest.mark.parametrize(("tp", "mode", "decode"), [(2, "auto", False), (4, "auto", False), (2, "low_latency", True)])
def test_static_shape_extend_gives_the_single_rank_tokens(tiny_checkpoint, tp, mode, decode):
    path = tiny_checkpoint("v3_groups")
    prompts = _prompts()
    ref = _single_rank(path, prompts)
    more = _continued(prompts)
    ref_more = _single_rank(path, more)
    eng = _engine(path, **dict(DP2, tp_size=tp, deepep_mode=mode), enable_static_shape_extend=True,
                  enable_static_shape_decode=decode, cuda_graph_max_bs=16)
    try:
        steps = _static_steps(eng)
        # both groups busy (the least-loaded group of each request)
        assert _ids(eng.generate(input_ids=prompts, sampling_params=GREEDY)) == ref
        steps = _padded_in_both(eng, steps)
        # one group idle: it runs every padded extend step of the other, a chunked long prompt's included
        long = max(range(len(prompts)), key=lambda i: len(prompts[i]))
        assert len(prompts[long]) > CHUNKED["chunked_prefill_size"]
        out = eng.generate(input_ids=prompts[long], sampling_params=GREEDY, data_parallel_rank=1)
        assert out["output_ids"] == ref[long]
        steps = _padded_in_both(eng, steps)
        # 1 request in group 0 beside 7 in group 1
        outs = eng.generate(input_ids=prompts, sampling_params=GREEDY, data_parallel_rank=[0] + [1] * 7)
        assert _ids(outs) == ref
        steps = _padded_in_both(eng, steps)
        # prefix hits: the prompts again with a few new tokens, each in its group of the last run
        outs = eng.generate(input_ids=more, sampling_params=GREEDY, data_parallel_rank=[0] + [1] * 7)
        assert _ids(outs) == ref_more
        assert all(o["meta_info"]["cached_tokens"] > 0 for o in outs), [o["meta_info"] for o in outs]
        _padded_in_both(eng, steps)
        decode_steps = [load.step_counts.get("static_decode", 0) for load in eng.get_load()]
        assert all(n > 0 for n in decode_steps) if decode else decode_steps == [0, 0], decode_steps
        # the padding never took a page: with the prefix cache flushed, every page is free
        assert eng.flush_cache()
        assert all(load.kv_used_tokens == 0 and load.num_cached_tokens == 0 for load in eng.get_load())
    finally:
        eng.shutdown()


def test_without_the_flag_the_same_tokens_run_eagerly(tiny_checkpoint):
    path = tiny_checkpoint("v3_groups")
    prompts = _prompts()
    eng = _engine(path, **DP2)
    try:
        assert _ids(eng.generate(input_ids=prompts, sampling_params=GREEDY, data_parallel_rank=[0] + [1] * 7)) \
            == _single_rank(path, prompts)
        assert all("static_extend" not in load.step_counts for load in eng.get_load())
    finally:
        eng.shutdown()
