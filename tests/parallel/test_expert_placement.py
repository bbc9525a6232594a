"""Expert placement at serving time (--init-expert-location, --ep-num-redundant-experts): each physical slot loads
the logical expert the placement gives it and tokens are routed through the rank's dispatch table, so any
placement, with or without replicas, gives the tokens of the plain single-rank run."""

from __future__ import annotations

import pytest
import torch

from moeserve.eplb.location import ExpertLocation
from moeserve.rank.sampling_params import SamplingParams
from tests.parallel.test_ep_generation import GREEDY, _prompts, single_rank_greedy
from tests.rank.inprocess import InProcessEngine

NAME = "v3_groups"  # 16 routed experts in 4 groups, 2 MoE layers
EXPERTS, MOE_LAYERS = 16, 2


def _shuffled_placement(redundant: int, seed: int) -> torch.Tensor:
    """[layers, 16 + redundant]: every expert once, `redundant` random experts again, all slots shuffled."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(MOE_LAYERS):
        slots = torch.cat([torch.arange(EXPERTS), torch.randint(0, EXPERTS, (redundant,), generator=gen)])
        rows.append(slots[torch.randperm(len(slots), generator=gen)])
    return torch.stack(rows)


def _run_single_rank(path: str, **kwargs) -> list[list[int]]:
    eng = InProcessEngine(model_path=path, dtype="float32", **kwargs)
    return [r["output_ids"] for r in eng.run(_prompts(), SamplingParams(**GREEDY))]


@pytest.mark.parametrize("redundant", [0, 4])
def test_single_rank_placement_file(tiny_checkpoint, tmp_path, redundant):
    path = tiny_checkpoint(NAME)
    placement = ExpertLocation.from_placement(_shuffled_placement(redundant, seed=redundant), ep_size=1)
    file = placement.save(tmp_path / "placement.json")
    assert _run_single_rank(path, init_expert_location=str(file),
                            ep_num_redundant_experts=redundant) == single_rank_greedy(NAME, path)


def test_single_rank_redundant_trivial_and_recorder_dump(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint(NAME)
    ref = single_rank_greedy(NAME, path)
    assert _run_single_rank(path, ep_num_redundant_experts=4) == ref  # slots 16..19 repeat experts 0..3
    gen = torch.Generator().manual_seed(3)
    dump = tmp_path / "expert_distribution_recorder.pt"
    torch.save({"logical_count": torch.randint(0, 100, (5, MOE_LAYERS, EXPERTS), generator=gen)}, dump)
    assert _run_single_rank(path, init_expert_location=str(dump), ep_num_redundant_experts=4) == ref


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [dict(tp_size=2, moe_a2a_backend="all2all", deepep_mode="auto",
                                         ep_max_tokens_per_rank=4, enable_dp_attention=True, dp_size=2),
                                    dict(tp_size=2, moe_a2a_backend="allgather")],
                         ids=["dp2-a2a_auto", "tp2-allgather"])
def test_two_ranks_shuffled_placement_with_replicas(tiny_checkpoint, tmp_path, kwargs):
    """Replicas on both ranks: the static table sends each rank's tokens to a replica on its own rank first."""
    from moeserve.server.engine import Engine

    path = tiny_checkpoint(NAME)
    file = ExpertLocation.from_placement(_shuffled_placement(4, seed=7), ep_size=2).save(tmp_path / "p.pt")
    eng = Engine(model_path=path, skip_tokenizer_init=True, dtype="float32", log_level="warning",
                 init_expert_location=str(file), ep_num_redundant_experts=4, **kwargs)
    try:
        outs = eng.generate(input_ids=_prompts(), sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == single_rank_greedy(NAME, path)
    finally:
        eng.shutdown()


def test_placement_for_another_model_is_refused(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint(NAME)
    file = ExpertLocation.trivial(3, EXPERTS, EXPERTS, 1).save(tmp_path / "three_layers.json")
    with pytest.raises(ValueError, match="3 MoE layers, the model has 2"):
        InProcessEngine(model_path=path, init_expert_location=str(file))


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(eplb_rebalance_num_iterations=0), "num-iterations must be >= 1"),
    (dict(eplb_min_rebalancing_utilization_threshold=1.5), "threshold must be in"),
    (dict(expert_distribution_recorder_mode="per_layer"), "choose one of"),
    (dict(expert_distribution_recorder_buffer_size=0), "buffer-size must be >= 1"),
    (dict(eplb_debug_fail="plan:0"), "prepare:RANK or execute:RANK"),
])
def test_bad_eplb_flags_say_so(kwargs, match):
    from moeserve.args import ServerArgs

    with pytest.raises(ValueError, match=match):
        ServerArgs(**kwargs)
