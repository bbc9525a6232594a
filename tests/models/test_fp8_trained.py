"""FP8 on the trained default model: greedy agreement and logits against the dequantized reference.

The checkpoint: the shipped default model (moeserve/models/default/) quantized with DeepSeek's recipe and saved in
DeepSeek's key layout (tests/checkpoints.py quantize_checkpoint); the reference: the same model holding the
dequantized weights in float32. Both run in float32 on one CPU rank, so they differ only by the activations'
rounding through e4m3 (per token, groups of 128) before each GEMM. Its hidden sizes are not all multiples of 128:
q_a_proj [64, 256], q_b_proj [192, 64], kv_a_proj_with_mqa [80, 256], kv_b_proj [256, 64] end in (or are) partial
blocks, which the recipe quantizes by what they hold (one scale per partial block, one per partial activation group
of 64); the experts' and dense MLP's 128 / 512 are whole blocks.

Prompts: 24 distinct held-out windows (Python's standard library, never trained on), the first 48 tokens of every
other window of moeserve/models/default_heldout.shipped_windows(); 64 greedy steps each.

Measured (torch 2.13 CPU): 8 of these 24 prompts (33%) agree on all 64 tokens, short of issue 15's 90%.
Teacher-forced on the reference's own continuations, the FP8 model picks the reference's token at 97.6% of the
positions; its centered logits are 3.3% off the reference's (median over positions; 26% at the 99th percentile).
Why the 64-step share is low, from the experiments in benchmark/results/ ("FP8 greedy agreement on the trained
default model", 24 other held-out prompts, 8 agree there too): with the activations' rounding turned off all
agree (the test below: weights, scales, partial blocks and layout are exact); rounding in groups of 16 or 32
instead of 128, or to 4 significant bits with no range limit, gives the same 6-9 of 24, so it is e4m3's 3-bit
mantissa, not the group size or the scales; rounding the activations to bf16's 8 significant bits instead gives
21 of 24, and the shipped model run in bf16 against float32 18 of 24. The model's margins are small (9% of its
greedy steps have a top-2 logit gap under 0.25) and 18% of the tokens go to another expert set in at least one
MoE layer under FP8 rounding, a larger step than a near tie. The bars below sit under the measurements and catch
gross errors; the test without rounding is the exact one (one layer's scale rows swapped fails it, and the
64-step bar).
"""

from __future__ import annotations

import pytest
import torch

from moeserve.models.default_heldout import shipped_windows
from moeserve.rank.sampling_params import SamplingParams
from tests.models.harness import Runner, without_activation_rounding
from tests.rank.inprocess import InProcessEngine

NUM_PROMPTS, PROMPT_LEN, STEPS = 24, 48, 64
ALL_STEPS_SHARE = 0.25  # prompts whose 64 greedy tokens all equal the reference's (measured 8/24 = 0.33)
POSITION_SHARE = 0.95  # teacher-forced positions whose top token equals the reference's (measured 0.976)
LOGITS_REL_MEDIAN = 0.05  # per position |logits - ref| / |ref|, both centered over the vocabulary (measured 0.033)
LOGITS_REL_P99 = 0.45  # its 99th percentile (measured 0.26: positions where an expert choice flipped)


def _prompts() -> list[list[int]]:
    windows = shipped_windows()[::2][:NUM_PROMPTS]
    assert len(windows) == NUM_PROMPTS
    return [w[:PROMPT_LEN] for w in windows]


def _greedy(path: str, prompts: list[list[int]]) -> list[list[int]]:
    sp = SamplingParams(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True)
    return [r["output_ids"] for r in InProcessEngine(model_path=path, dtype="float32", device="cpu").run(prompts, sp)]


def _next_token_logits(path: str, prompts: list[list[int]], continuations: list[list[int]]) -> torch.Tensor:
    """[NUM_PROMPTS, STEPS, V]: the logits that predict each continuation token, prompt + continuation in one
    prefill."""
    seqs = [p + c for p, c in zip(prompts, continuations, strict=True)]
    logits = Runner(path, num_slots=sum(map(len, seqs)) + 64).extend(list(enumerate(seqs)))
    out, start = [], 0
    for p, s in zip(prompts, seqs, strict=True):
        out.append(logits[start + len(p) - 1:start + len(s) - 1])
        start += len(s)
    return torch.stack(out)


@pytest.fixture(scope="module")
def runs(shipped_fp8_checkpoint) -> dict:
    fp8, ref = shipped_fp8_checkpoint
    prompts = _prompts()
    want = _greedy(ref, prompts)
    return dict(fp8=fp8, ref=ref, prompts=prompts, want=want, got=_greedy(fp8, prompts),
                fp8_logits=_next_token_logits(fp8, prompts, want), ref_logits=_next_token_logits(ref, prompts, want))


def test_prompts_are_distinct_held_out_text(runs):
    assert len({tuple(p) for p in runs["prompts"]}) == NUM_PROMPTS


def test_greedy_64_steps_agree_with_the_dequantized_reference(runs):
    """Share of prompts whose 64 greedy tokens all equal the reference's (see the module docstring for why it is
    below issue 15's 90%)."""
    same = sum(g == w for g, w in zip(runs["got"], runs["want"], strict=True))
    print(f"FP8 greedy, trained default model: {same}/{NUM_PROMPTS} prompts agree on all {STEPS} tokens")
    assert same >= ALL_STEPS_SHARE * NUM_PROMPTS


def test_logits_within_tolerance_of_the_dequantized_reference(runs):
    got, want = runs["fp8_logits"], runs["ref_logits"]
    assert torch.equal(want.argmax(-1), torch.tensor(runs["want"]))  # the reference's logits pick its own tokens
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= POSITION_SHARE
    g, w = got - got.mean(-1, keepdim=True), want - want.mean(-1, keepdim=True)
    rel = ((g - w).norm(dim=-1) / w.norm(dim=-1)).flatten()
    assert float(rel.median()) < LOGITS_REL_MEDIAN
    assert float(rel.quantile(0.99)) < LOGITS_REL_P99


def test_without_activation_rounding_all_64_steps_agree(runs, monkeypatch):
    """The FP8 weights, their scales (partial blocks included) and DeepSeek's layout are exact: with the activations'
    rounding turned off every prompt's 64 greedy tokens equal the reference's."""
    without_activation_rounding(monkeypatch)
    assert _greedy(runs["fp8"], runs["prompts"]) == runs["want"]
