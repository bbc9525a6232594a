"""Dense layers in data parallel, as SGLang's large-EP commands run them: --moe-dense-tp-size 1 (each rank's dense
MLPs on its own DP group's tokens, no all-reduce) and --enable-dp-lm-head (the LM head split by vocabulary over each
attention-TP group, the logits gathered there).

Greedy tokens of random prompts on 2 CPU ranks in 2 DP groups, and on 4 ranks in 2 DP groups of 2 (where the LM head
is really split: half of the vocabulary per rank; also with the LM head tied to the embeddings), must equal the
single-rank in-process run (which test_generation ties to transformers).
"""

from __future__ import annotations

import random

import pytest

from moeserve.rank.sampling_params import SamplingParams
from tests.checkpoints import VOCAB, build_checkpoint
from tests.rank.inprocess import InProcessEngine

pytestmark = pytest.mark.slow

GREEDY = dict(max_new_tokens=16, temperature=0.0, ignore_eos=True)
DP2 = dict(tp_size=2, dp_size=2, enable_dp_attention=True, moe_a2a_backend="all2all")
# dp2-dp_lm_head runs the dense layers at TP 1 too (a run of --moe-dense-tp-size 1 alone repeated that path; the
# default LM head under DP attention runs in test_ep_generation.py's dp2 cases).
CASES = {
    "dp2-dp_lm_head": dict(DP2, enable_dp_lm_head=True, moe_dense_tp_size=1),
    "tp4-dp2-dp_lm_head": dict(DP2, tp_size=4, enable_dp_lm_head=True),
    "tp4-dp2-dp_lm_head-tied": dict(DP2, tp_size=4, enable_dp_lm_head=True),
}
_REF: dict[str, list[list[int]]] = {}


def _prompts() -> list[list[int]]:
    rng = random.Random(49)
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 40))] for _ in range(5)]


def _single_rank(path: str) -> list[list[int]]:
    if path not in _REF:
        eng = InProcessEngine(model_path=path, dtype="float32")
        _REF[path] = [r["output_ids"] for r in eng.run(_prompts(), SamplingParams(**GREEDY))]
    return _REF[path]


@pytest.mark.parametrize("case", CASES)
def test_dp_dense_layers_and_lm_head_give_the_single_rank_tokens(tiny_checkpoint, tmp_path_factory, case):
    from moeserve.server.engine import Engine

    if case.endswith("tied"):  # the LM head is the embeddings: each rank multiplies by its rows of them
        path = str(build_checkpoint("qwen3_moe", tmp_path_factory.mktemp("tied"), tie_word_embeddings=True))
    else:
        path = tiny_checkpoint("v3_groups")  # one dense layer (first_k_dense_replace 1), then MoE layers
    ref = _single_rank(path)
    eng = Engine(model_path=path, skip_tokenizer_init=True, dtype="float32", log_level="warning", **CASES[case])
    try:
        outs = eng.generate(input_ids=_prompts(), sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == ref
        assert all(load.num_cached_tokens > 0 for load in eng.get_load())  # both groups served requests
        assert eng.generate(input_ids=_prompts()[0], sampling_params=GREEDY)["output_ids"] == ref[0]  # one group idle
    finally:
        eng.shutdown()
