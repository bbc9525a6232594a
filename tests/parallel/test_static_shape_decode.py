"""Static-shape decode with several DP groups (moeserve/rank/static_shape.py), on CPU ranks.

With --enable-static-shape-decode every group runs each decode step at one padded batch size that all ranks agree
on through the step header (the largest group's, bucketed as the CUDA graphs are), an idle group too. Greedy tokens
of random prompts on 2 ranks (2 DP groups) and on 4 ranks (2 groups of 2) must equal the single-rank in-process
run's (which test_generation ties to transformers): with both groups busy, with one group idle, and with 1 request
in one group beside 7 in the other; through all2all, and on 2 ranks through symm. The groups' step counts show the
padded path ran; without the flag, the eager run gives the same tokens and runs no padded step.
Two-batch overlap is decided per step from the header: every step with a largest group of N tokens overlaps iff
N >= --tbo-token-threshold, padded decode steps included.
"""

from __future__ import annotations

import random

import pytest

from moeserve.rank.sampling_params import SamplingParams
from tests.rank.inprocess import InProcessEngine

pytestmark = pytest.mark.slow

GREEDY = dict(max_new_tokens=12, temperature=0.0, ignore_eos=True)
DP2 = dict(tp_size=2, dp_size=2, enable_dp_attention=True, moe_a2a_backend="all2all")
_REF: dict[str, list[list[int]]] = {}
_ENGINES: dict[tuple, object] = {}


def _prompts(n: int = 8, seed: int = 49) -> list[list[int]]:
    from tests.checkpoints import VOCAB

    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


def _single_rank(path: str) -> list[list[int]]:
    if path not in _REF:
        eng = InProcessEngine(model_path=path, dtype="float32")
        _REF[path] = [r["output_ids"] for r in eng.run(_prompts(), SamplingParams(**GREEDY))]
    return _REF[path]


@pytest.fixture(scope="module")
def engines():
    yield _ENGINES
    for eng in _ENGINES.values():
        eng.shutdown()
    _ENGINES.clear()


def _engine(path: str, **kw):
    from moeserve.server.engine import Engine

    key = (path, *sorted(kw.items()))
    if key not in _ENGINES:
        _ENGINES[key] = Engine(model_path=path, skip_tokenizer_init=True, dtype="float32", log_level="warning",
                               cuda_graph_max_bs=16, **kw)
    return _ENGINES[key]


def _static_steps(eng) -> list[int]:
    return [load.step_counts.get("static_decode", 0) for load in eng.get_load()]


def test_without_the_flag_no_decode_step_is_padded(tiny_checkpoint, engines):
    """The eager multi-rank run: the single-rank tokens, and no padded step. One layout is enough: the flag is read
    the same way on every layout, and test_ep_generation.py checks the eager tokens of the layouts the static test
    below runs (v3_groups on 4 ranks with all2all; the symm backend under DP attention)."""
    path = tiny_checkpoint("v3_groups")
    eager = _engine(path, **DP2)
    assert [o["output_ids"] for o in eager.generate(input_ids=_prompts(), sampling_params=GREEDY)] == _single_rank(path)
    assert _static_steps(eager) == [0, 0]


@pytest.mark.parametrize(("tp", "backend"), [(2, "all2all"), (4, "all2all"), (2, "symm")])
def test_static_shape_decode_gives_the_single_rank_tokens(tiny_checkpoint, engines, tp, backend):
    path = tiny_checkpoint("v3_groups")
    ref = _single_rank(path)
    prompts = _prompts()
    static = _engine(path, **dict(DP2, tp_size=tp, moe_a2a_backend=backend), enable_static_shape_decode=True)

    # both groups busy
    assert [o["output_ids"] for o in static.generate(input_ids=prompts, sampling_params=GREEDY)] == ref
    before = _static_steps(static)
    assert all(n >= GREEDY["max_new_tokens"] - 1 for n in before), before
    # one group idle: it runs every padded decode step of the other
    assert static.generate(input_ids=prompts[3], sampling_params=GREEDY, data_parallel_rank=1)["output_ids"] == ref[3]
    after = _static_steps(static)
    assert after[0] - before[0] == after[1] - before[1] >= GREEDY["max_new_tokens"] - 1, (before, after)
    # 1 request in group 0 beside 7 in group 1
    outs = static.generate(input_ids=prompts, sampling_params=GREEDY, data_parallel_rank=[0] + [1] * 7)
    assert [o["output_ids"] for o in outs] == ref
    final = _static_steps(static)
    assert final[0] - after[0] == final[1] - after[1] >= GREEDY["max_new_tokens"] - 1, (after, final)


def test_two_batch_overlap_is_decided_per_step_from_the_header(tiny_checkpoint, engines):
    path = tiny_checkpoint("v3_groups")
    ref = _single_rank(path)
    threshold = 8
    eng = _engine(path, **DP2, enable_static_shape_decode=True, enable_two_batch_overlap=True,
                  tbo_token_threshold=threshold)
    outs = eng.generate(input_ids=_prompts(), sampling_params=GREEDY, data_parallel_rank=[0] + [1] * 7)
    assert [o["output_ids"] for o in outs] == ref
    # one request alone: its decode steps (1 token, the other group idle at the padded size 1) do not overlap
    assert eng.generate(input_ids=_prompts()[0], sampling_params=GREEDY, data_parallel_rank=0)["output_ids"] == ref[0]
    for load in eng.get_load():
        steps = {k: v for k, v in load.step_counts.items() if k != "static_decode"}
        tokens = {int(k.split()[1]): k.split()[0] for k in steps}
        assert all((kind == "tbo") == (n >= threshold) for n, kind in tokens.items()), steps
        assert "tbo" in tokens.values() and "no_tbo" in tokens.values(), steps  # both kinds of step ran
        # the decode steps of 1 beside 7 requests run padded to the bucket 8: they overlap (7 alone would not)
        assert steps.get("tbo 8", 0) >= GREEDY["max_new_tokens"] - 1, steps
        assert steps.get("no_tbo 1", 0) >= GREEDY["max_new_tokens"] - 1, steps
