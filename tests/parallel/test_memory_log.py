"""The per-rank start-up memory line and the periodic expert-utilization line (ModelRunner, worker log).

One rank in-process (caplog): the memory line's numbers are the runner's own, and the utilization counter counts
exactly tokens x top-k x MoE layers (distinct top-k experts, LocalDispatcher). Two ranks through the Engine
(DP attention 2, all2all auto: the low-latency buffers are allocated at start): each rank logs its line with half the experts and
the dispatch buffers the constructor parameters give, and the utilization lines of both ranks add up to at most
the pairs the batch routed (the last interval may end after the final log line) and to more than none.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch

from moeserve.rank.sampling_params import SamplingParams
from tests.rank.inprocess import InProcessEngine

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26]]
NEW = 6
GREEDY = dict(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
# default model: DeepSeek-V3 style, 4 layers (first dense), 16 routed experts, top-4, hidden 256
MOE_LAYERS, EXPERTS, TOP_K, HIDDEN = 3, 16, 4, 256
PAIRS = (sum(map(len, PROMPTS)) + len(PROMPTS) * (NEW - 1)) * TOP_K * MOE_LAYERS


@pytest.mark.parametrize("backend", ["auto", "grouped_gemm"])
def test_one_rank_memory_and_utilization_lines(caplog, backend):
    """auto: the CPU kernel counts the pairs; grouped_gemm: the experts' first grouped GEMM adds them (`tally`)."""
    from moeserve.models.default_model import default_model_path

    with caplog.at_level(logging.INFO, logger="moeserve.rank.model_runner"):
        eng = InProcessEngine(model_path=default_model_path(), dtype="float32", moe_runner_backend=backend)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Memory: rank")]
    assert len(lines) == 1, caplog.text
    r = eng.runner
    assert r.ep.num_moe_layers == MOE_LAYERS and r.ep.num_local_experts == r.ep.num_physical_experts == EXPERTS
    assert 0 < r.ep.expert_bytes < r.weight_bytes
    # routed experts: 3 matrices of H x moe_intermediate per expert and layer, fp32
    assert r.ep.expert_bytes % (MOE_LAYERS * EXPERTS * 3 * HIDDEN * 4) == 0
    assert r.ep.backend == "none" and r.ep.dispatch_buffer_bytes == 0
    assert "16 of 16 experts in each of 3 MoE layers" in lines[0] and "EP dispatch" not in lines[0]
    assert f"({r.num_pages * r.args.page_size} tokens, page size" in lines[0]

    assert r.expert_utilization_line(1.0) is None  # nothing ran yet
    eng.run(PROMPTS, SamplingParams(**GREEDY))
    line = r.expert_utilization_line(2.0)
    assert line is not None and line.startswith("Expert utilization: rank 0 (EP rank 0/1, experts 0-15 of 16)")
    assert f": {PAIRS} token-expert pairs over 3 MoE layers in 2.0 s" in line, line
    assert r.expert_utilization_line(1.0) is None  # taken: the counter starts again from zero


def test_packed_experts_replace_the_plain_ones():
    """bf16 where the packed CPU kernels run (AVX-512 BF16): the experts are held packed, in the same bytes as plain
    ones (no second copy), and the memory line says so; float32 experts are not packed."""
    from moeserve.kernels import cpu_experts

    eng = InProcessEngine(model_path=None, dtype="bfloat16")
    r = eng.runner
    if not cpu_experts.packed_runs():
        assert not r.experts_packed and "packed" not in r.memory_line()
        pytest.skip("the packed experts kernels do not run on this CPU")
    assert r.experts_packed and r.ep.expert_bytes == MOE_LAYERS * EXPERTS * 3 * HIDDEN * 128 * 2
    assert f"(routed experts {r.ep.expert_bytes / 2**20:.2f} MiB packed for the CPU kernels: 16 of 16" in r.memory_line()
    assert not InProcessEngine(model_path=None, dtype="float32").runner.experts_packed


@pytest.mark.slow
def test_two_rank_memory_lines_and_utilization(capfd):
    from moeserve.models.default_model import default_model_path
    from moeserve.server.engine import Engine

    cap = 4
    eng = Engine(model_path=default_model_path(), skip_tokenizer_init=True, dtype="float32", log_level="info",
                 tp_size=2, enable_dp_attention=True, dp_size=2, moe_a2a_backend="all2all", deepep_mode="auto", ep_max_tokens_per_rank=cap,
                 log_interval_s=0.05)
    try:
        outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert all(len(o["output_ids"]) == NEW for o in outs)
    finally:
        eng.shutdown()
    err = capfd.readouterr().err
    mem = re.findall(r"\[rank (\d)\] INFO moeserve\.rank\.model_runner: (Memory: rank .*)", err)
    assert sorted(int(r) for r, _ in mem) == [0, 1], err[-3000:]
    # low-latency buffers per layer: send + recv x [R * cap, H] fp32, send + recv meta [R * cap, 2k] int32
    ll_bytes = MOE_LAYERS * (2 * 2 * cap * HIDDEN * 4 + 2 * 2 * cap * 2 * TOP_K * 4)
    for rank, line in mem:
        assert line.startswith(f"Memory: rank {rank}/2 (EP rank {rank}/2): weights "), line
        assert "(routed experts " in line and ": 8 of 16 experts in each of 3 MoE layers)" in line, line
        assert f"EP dispatch buffers {ll_bytes / 2**10:.2f} KiB (all2all auto, low-latency slots of {cap} tokens" \
            in line, line
    util = re.findall(r"\[rank (\d)\] INFO moeserve\.rank\.model_runner: Expert utilization: rank \d "
                      r"\(EP rank \d/2, experts (\d+)-(\d+) of 16\): (\d+) token-expert pairs", err)
    util += re.findall(r"\[rank (\d)\] INFO moeserve\.rank\.worker: Expert utilization: rank \d "
                       r"\(EP rank \d/2, experts (\d+)-(\d+) of 16\): (\d+) token-expert pairs", err)
    assert util, err[-3000:]
    for rank, first, last, _ in util:
        assert (int(first), int(last)) == ((0, 7) if rank == "0" else (8, 15))
    # DP attention: each token is dispatched once (under attention TP every rank of a group would dispatch the
    # group's tokens, and the pairs would count attn_tp_size times)
    assert 0 < sum(int(n) for *_, n in util) <= PAIRS


def test_counter_ignores_other_expert_counts():
    from moeserve.ep.stats import LocalExpertTokens

    ours = LocalExpertTokens(4, "cpu")
    ours.add(torch.arange(4))
    ours.add(torch.ones(6, dtype=torch.int64))  # another model's layer, with another expert count
    assert ours.take() == [0, 1, 2, 3]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a second device")
def test_counter_ignores_other_devices():
    """A GPU engine's counter and a CPU model in the same process (tests/models/test_gpu.py after the engine
    tests): the CPU model's layers, with as many experts, are not counted and do not fail."""
    from moeserve.ep.stats import LocalExpertTokens

    ours = LocalExpertTokens(4, "cuda")
    ours.add(torch.ones(4, dtype=torch.int64))
    ours.add(torch.arange(4, device="cuda"))
    assert ours.take() == [0, 1, 2, 3]
