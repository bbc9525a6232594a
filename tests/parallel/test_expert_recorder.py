"""The expert-distribution recorder (--expert-distribution-recorder-mode stat) through the offline Engine: the
dump counts every token each MoE layer routed, once, whatever the ranks; it is a window (start / stop); and it
plans a placement the server then runs with."""

from __future__ import annotations

import random

import pytest
import torch

from tests.checkpoints import VOCAB

NAME = "v3_groups"  # 16 routed experts top-4, 2 MoE layers
NEW = 8
PARAMS = dict(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in (5, 17, 33, 9, 40, 2)]


def _routed_pairs(prompts: list[list[int]], top_k: int = 4) -> int:
    """Per MoE layer: every prompt token and every generated token but the last goes through it once."""
    return sum(len(p) + NEW - 1 for p in prompts) * top_k


def _record(path: str, dump: str, mode: str = "stat", full: bool = False, **kwargs) -> torch.Tensor | dict:
    from moeserve.server.engine import Engine

    eng = Engine(model_path=path, skip_tokenizer_init=True, dtype="float32", log_level="warning",
                 expert_distribution_recorder_mode=mode, **kwargs)
    try:
        eng.generate(input_ids=_prompts(0), sampling_params=PARAMS)  # before the window: not counted
        eng.start_expert_distribution_record()
        eng.generate(input_ids=_prompts(1), sampling_params=PARAMS)
        eng.stop_expert_distribution_record()
        eng.generate(input_ids=_prompts(2), sampling_params=PARAMS)  # after: not counted
        info = eng.dump_expert_distribution_record(dump)
    finally:
        eng.shutdown()
    record = torch.load(info["path"])
    counts = record["logical_count"]
    assert info["path"] == dump and info["token_expert_pairs"] == int(counts.sum()) and info["mode"] == mode
    return record if full else counts


DP2 = dict(tp_size=2, dp_size=2, enable_dp_attention=True, moe_a2a_backend="all2all")


@pytest.fixture(scope="module")
def stat_dump(tiny_checkpoint, tmp_path_factory):
    """stat_dump(**layout) -> (dump path, counts): NAME's stat recording on that layout, made once per module and
    read by every test that needs it (each recording is an Engine start; greedy tokens give the same counts)."""
    done: dict[tuple, tuple[str, torch.Tensor]] = {}

    def get(**layout) -> tuple[str, torch.Tensor]:
        key = tuple(sorted(layout.items()))
        if key not in done:
            dump = str(tmp_path_factory.mktemp("stat") / "dump.pt")
            done[key] = dump, _record(tiny_checkpoint(NAME), dump, **layout)
        return done[key]

    return get


def test_one_rank_counts_the_window(stat_dump):
    _, counts = stat_dump()
    assert counts.shape == (1, 2, 16) and counts.dtype == torch.int64
    assert counts.sum(-1).tolist() == [[_routed_pairs(_prompts(1))] * 2]


@pytest.mark.slow
def test_two_ranks_count_what_one_rank_counts(stat_dump):
    """DP attention, EP 2: each group counts its own requests and the dump sums them; the same routing decisions
    as one rank (the tokens are the same), so the same counts, expert by expert."""
    assert torch.equal(stat_dump()[1], stat_dump(**DP2)[1])


def test_dump_plans_a_placement_the_server_runs(stat_dump):
    from moeserve.eplb.location import ExpertLocation

    dump, counts = stat_dump()
    loc = ExpertLocation.load(dump, ep_size=2, num_physical_experts=20, num_groups=4,
                              num_layers=2, num_logical_experts=16)
    hot = counts[0].argmax(-1)  # the busiest expert of each layer gets a replica
    assert all(int(loc.logical_to_all_physical_map_num_valid[i, e]) >= 2 for i, e in enumerate(hot.tolist()))


def test_recording_needs_the_flag(tiny_checkpoint):
    from moeserve.server.engine import Engine

    eng = Engine(model_path=tiny_checkpoint(NAME), skip_tokenizer_init=True, log_level="warning")
    try:
        with pytest.raises(ValueError, match="--expert-distribution-recorder-mode stat"):
            eng.start_expert_distribution_record()
    finally:
        eng.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_per_pass_and_per_token_count_exactly_the_routed_tokens(tiny_checkpoint, stat_dump, tmp_path, ranks):
    """per_pass: each pass's counts, summing to what stat counts over the window; per_token: every routed token's
    experts, whose histogram is the same counts. The passes of a window are consecutive; one token per routed row."""
    path = tiny_checkpoint(NAME)
    parallel = DP2 if ranks == 2 else {}
    stat = stat_dump(**parallel)[1]
    per_pass = _record(path, str(tmp_path / "pass.pt"), "per_pass", full=True, **parallel)
    per_token = _record(path, str(tmp_path / "token.pt"), "per_token", full=True,
                        expert_distribution_recorder_buffer_size=4096, **parallel)
    passes = per_pass["logical_count"]
    assert passes.dim() == 3 and passes.shape[1:] == (2, 16) and passes.shape[0] >= NEW
    ids = per_pass["forward_pass_id"].tolist()
    assert ids == list(range(ids[0], ids[0] + len(ids)))
    assert torch.equal(passes.sum(0, keepdim=True), stat)
    topk = per_token["topk_ids"]  # [tokens, layers, k]
    assert topk.shape == (_routed_pairs(_prompts(1)) // 4, 2, 4)
    hist = torch.stack([torch.bincount(topk[:, i].reshape(-1), minlength=16) for i in range(2)])
    assert torch.equal(hist[None], stat) and torch.equal(per_token["logical_count"], stat)

