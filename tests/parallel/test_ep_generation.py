"""Multi-rank generation on CPU (gloo): expert parallelism with attention TP or DP, every dispatch backend.

The offline Engine spawns the rank processes. One mixed batch of prompts (32 new greedy tokens each, ignore_eos)
must be token-identical to the single-rank in-process run of the same checkpoint (which test_generation ties to
transformers), and its log-probs must agree within LOGPROB_ATOL. Configurations: on v3_groups (MLA, grouped
top-k, a shared expert) the whole matrix: attention TP (tp 2) / DP attention (tp 2, dp 2) x allgather / all2all
normal / all2all low_latency (ep_max_tokens_per_rank 4, so prefill steps run several rounds) / all2all auto x
two-batch overlap off / on; on qwen3_moe, mixtral and v2_lite a few cases each: the MoE without a shared expert
under two-batch overlap, and each model's attention and experts split under both attention modes (see CASES for
why that is enough); plus the default backend `none` (allgather when ep_size > 1), a 4-rank case (DP 2 x
attention TP 2), and --enable-mixed-chunk with small chunks (prompt chunks beside the running decodes) under
attention TP and under DP attention with two-batch overlap; and --ep-size 1 (a tensor-parallel MoE under attention
TP, whole experts per rank under DP attention); and the symm backend under DP attention (low-latency with
two-batch overlap, and auto).
With DP attention, both groups must have served requests (each group's radix cache holds tokens afterwards), and a
lone request (one group busy, the other stepping IDLE batches) must match too.
"""

from __future__ import annotations

import random

import pytest

from moeserve.rank.sampling_params import SamplingParams
from tests.checkpoints import VOCAB
from tests.rank.inprocess import InProcessEngine

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
MIXED = [5, 17, 33, 9, 64, 2]
GREEDY = dict(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

BACKENDS = {
    "allgather": dict(moe_a2a_backend="allgather"),
    "a2a_normal": dict(moe_a2a_backend="all2all", deepep_mode="normal"),
    "a2a_low_latency": dict(moe_a2a_backend="all2all", deepep_mode="low_latency", ep_max_tokens_per_rank=4),
    "a2a_auto": dict(moe_a2a_backend="all2all", deepep_mode="auto", ep_max_tokens_per_rank=4),
}
ATTN = {
    "attn_tp2": dict(tp_size=2),
    "dp2": dict(tp_size=2, enable_dp_attention=True, dp_size=2),
}
TBO = {"tbo_off": {}, "tbo_on": dict(enable_two_batch_overlap=True, tbo_token_threshold=1)}
# Each case starts an Engine (2 to 4 rank processes, seconds on two cores): one case per distinct path.
# The backends and two-batch overlap see hidden states, top-k ids and weights, whatever model made them. The whole
# matrix runs on v3_groups (MLA with q_lora; 16 experts, top-4 over groups, 8 per rank; a shared expert, which
# two-batch overlap overlaps with the dispatch). The MoE without a shared expert, with overlap on: qwen3_moe (GQA
# with q/k norm; 8 experts, top-2) under both attention modes through allgather and through all2all auto (normal
# on prefill steps, low_latency on decode steps), mixtral through normal alone and low_latency alone (prefill in
# rounds). What else is the model's own in a multi-rank run: how its attention splits over attention TP, and how
# its experts, shared experts and dense layers shard over the ranks. mixtral (GQA without q/k norm; 4 experts, 2
# per rank; no dense layer; more cases below) and v2_lite (MLA without q_lora; 2 shared experts) run both
# attention modes, with several backends between them.
FULL_MATRIX = [(a, b, t) for a in ATTN for b in BACKENDS for t in TBO]
CASES = [("v3_groups", f"{a}-{b}-{t}", {**ATTN[a], **BACKENDS[b], **TBO[t]}) for a, b, t in FULL_MATRIX]
CASES += [(model, f"{a}-{b}-{t}", {**ATTN[a], **BACKENDS[b], **TBO[t]}) for model, a, b, t in [
    ("qwen3_moe", "attn_tp2", "allgather", "tbo_on"), ("qwen3_moe", "attn_tp2", "a2a_auto", "tbo_on"),
    ("qwen3_moe", "dp2", "allgather", "tbo_on"), ("qwen3_moe", "dp2", "a2a_auto", "tbo_on"),
    ("mixtral", "attn_tp2", "allgather", "tbo_off"), ("mixtral", "attn_tp2", "a2a_low_latency", "tbo_on"),
    ("mixtral", "dp2", "a2a_normal", "tbo_on"),
    ("v2_lite", "attn_tp2", "a2a_auto", "tbo_on"), ("v2_lite", "dp2", "allgather", "tbo_off"),
    ("v2_lite", "dp2", "a2a_low_latency", "tbo_on")]]
MIXED_CHUNK = dict(enable_mixed_chunk=True, chunked_prefill_size=16)  # chunks of the prompts run beside decodes
CASES += [
    ("qwen3_moe", "attn_tp2-none", dict(tp_size=2)),  # the default backend: none means allgather for ep_size 2
    # --enable-mixed-chunk: a mixed step is an extend in the header (auto dispatch picks normal), TBO splits it
    ("v3_groups", "attn_tp2-a2a_auto-mixed", dict(tp_size=2, **BACKENDS["a2a_auto"], **MIXED_CHUNK)),
    ("mixtral", "dp2-a2a_auto-tbo_on-mixed",
     dict(**ATTN["dp2"], **BACKENDS["a2a_auto"], **TBO["tbo_on"], **MIXED_CHUNK)),
    ("v3_groups", "tp4-dp2-a2a_auto",
     dict(tp_size=4, enable_dp_attention=True, dp_size=2, **{k: v for k, v in BACKENDS["a2a_auto"].items()})),
    # --moe-a2a-backend symm (row puts into shared memory): low-latency every step (prefill in rounds of 4 tokens)
    # with two-batch overlap, and auto (prefill by all2all normal, decode by symm)
    ("v3_groups", "dp2-symm_low_latency-tbo_on",
     dict(**ATTN["dp2"], moe_a2a_backend="symm", deepep_mode="low_latency", ep_max_tokens_per_rank=4, **TBO["tbo_on"])),
    ("mixtral", "dp2-symm_auto", dict(**ATTN["dp2"], moe_a2a_backend="symm", deepep_mode="auto",
                                      ep_max_tokens_per_rank=4)),
    # --ep-size 1: a tensor-parallel MoE (each expert's intermediate dimension split, tests/parallel/test_tp_moe.py)
    # through the server's ranks, with two-batch overlap too; with DP attention, whole experts per DP rank
    ("v3_groups", "attn_tp2-tp_moe", dict(tp_size=2, ep_size=1)),
    ("mixtral", "attn_tp2-tp_moe-tbo_on", dict(tp_size=2, ep_size=1, **TBO["tbo_on"])),
    ("v3_groups", "dp2-ep1", dict(**ATTN["dp2"], ep_size=1)),
]

_REF: dict[str, tuple[list[list[int]], list[list[float]]]] = {}
LOGPROB_ATOL = 2e-4  # float32; the ranks sum partial results in another order than one rank does


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in MIXED]


def single_rank_greedy(name: str, path: str) -> list[list[int]]:
    return _single_rank(name, path)[0]


def _single_rank(name: str, path: str) -> tuple[list[list[int]], list[list[float]]]:
    """Tokens and their log-probs (log-softmax of the logits) of the single-rank run."""
    if name not in _REF:
        eng = InProcessEngine(model_path=path, dtype="float32")
        res = eng.run(_prompts(), SamplingParams(**GREEDY), return_logprob=True)
        _REF[name] = ([r["output_ids"] for r in res], [r["logprobs"] for r in res])
    return _REF[name]


@pytest.mark.parametrize(("name", "config", "kwargs"), CASES, ids=[f"{m}-{c}" for m, c, _ in CASES])
def test_multi_rank_greedy_matches_single_rank(tiny_checkpoint, name, config, kwargs):
    from moeserve.server.engine import Engine

    path = tiny_checkpoint(name)
    ref, ref_logprobs = _single_rank(name, path)
    eng = Engine(model_path=path, skip_tokenizer_init=True, dtype="float32", log_level="warning", **kwargs)
    try:
        outs = eng.generate(input_ids=_prompts(), sampling_params=GREEDY, return_logprob=True)
        assert [o["output_ids"] for o in outs] == ref
        got = [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]
        for g, r in zip(got, ref_logprobs, strict=True):
            assert max(abs(a - b) for a, b in zip(g, r, strict=True)) <= LOGPROB_ATOL
        if kwargs.get("enable_dp_attention"):
            loads = eng.get_load()
            assert len(loads) == kwargs["dp_size"]
            # every group prefilled some of the (concurrently submitted) prompts: its radix cache holds them
            assert all(load.num_cached_tokens > 0 for load in loads), loads
            assert all(load.num_running == 0 and load.num_waiting == 0 for load in loads), loads
            # one request alone: one group works, the other runs IDLE batches through the MoE collectives
            assert eng.generate(input_ids=_prompts()[2], sampling_params=GREEDY)["output_ids"] == ref[2]
    finally:
        eng.shutdown()
