"""Online EPLB on a DeepSeek-format FP8 checkpoint (e4m3 experts with 128 x 128 block scales, made in the test, its
router skewed): on 2 and 4 CPU ranks with DP attention and all2all, a rebalance every few forward passes while
requests keep arriving moves each expert's weights with its scales (the tokens stay those of the run without EPLB),
balances the load, and a fault in either phase leaves the old placement serving."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.parallel import test_eplb_online as online

HOT = [0, 1]  # v3_fp8: 8 routed experts, top-2, 2 MoE layers; both hot experts on EP rank 0 at start
EPLB = dict(enable_eplb=True, eplb_rebalance_num_iterations=3, eplb_rebalance_layers_per_chunk=1)
PARALLEL = dict(enable_dp_attention=True, moe_a2a_backend="all2all")


@pytest.fixture(scope="module")
def skewed_fp8(fp8_checkpoint, tmp_path_factory) -> str:
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("skewed_fp8")
    shutil.copytree(fp8_checkpoint[0], out, dirs_exist_ok=True)
    weights = load_file(str(out / "model.safetensors"))
    assert any(k.endswith("experts.0.down_proj.weight_scale_inv") for k in weights)  # block-scaled experts
    for key in weights:
        if key.endswith("e_score_correction_bias"):
            bias = torch.zeros_like(weights[key])
            bias[HOT] = torch.tensor([3.0, 2.0])
            weights[key] = bias
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


_REF: dict[tuple, list[list[int]]] = {}


def _without_eplb(path: str, **kwargs) -> list[list[int]]:
    """The greedy tokens of the same server without EPLB (FP8 activations round per token, so a batch split
    otherwise than one rank's can move a near tie: the reference runs the same ranks and dispatcher)."""
    key = (path, *sorted(kwargs.items()))
    if key not in _REF:
        _REF[key] = [o["output_ids"] for o in online._serve(path, **kwargs)[0]]
    return _REF[key]


# deepep_mode auto runs both dispatchers in one serve, each after rebalances moved experts: normal on every step
# where a rank prefills, low_latency (FP8 activations with their scales in the slots) on the decode-only steps.
# A serve of normal alone or of low_latency alone repeats those paths (test_eplb_online.py runs each mode alone,
# with and without TBO); the moves of FP8 weights with their scales are the same code under every mode.
# Cases: 2 ranks; 2 ranks with TBO (split batches); 4 ranks (2 slots each).
CASES = [(2, "auto", False), (2, "auto", True), (4, "auto", False)]


@pytest.mark.slow
@pytest.mark.parametrize(("ranks", "mode", "tbo"), CASES,
                         ids=[f"ep{r}-{m}" + ("-tbo" if t else "") for r, m, t in CASES])
def test_fp8_rebalances_keep_the_tokens_and_balance_the_load(skewed_fp8, ranks, mode, tbo):
    flags = dict(tp_size=ranks, dp_size=ranks, deepep_mode=mode, **PARALLEL)
    if tbo:  # two-batch overlap on every step with two or more tokens
        flags |= dict(enable_two_batch_overlap=True, tbo_token_threshold=2)
    outs, report = online._serve(skewed_fp8, **flags, **EPLB)
    assert [o["output_ids"] for o in outs] == _without_eplb(skewed_fp8, **flags)
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    assert report.rebalances >= 1 and report.num_stalls >= 2  # chunks of one MoE layer each
    first = report.windows[0][1]  # the window before any rebalance: every hot expert on rank 0
    # two ranks: the two hot experts end on different ranks; four ranks (2 slots each, no redundant slots): the
    # busiest rank still holds one hot expert, so only the gain is asked for
    assert report.balancedness >= 0.9 if ranks == 2 else report.balancedness > first


@pytest.mark.slow
@pytest.mark.parametrize("fail", ["prepare:1", "execute:0"])
def test_fp8_failed_rebalance_keeps_the_old_placement(skewed_fp8, fail):
    flags = dict(tp_size=2, dp_size=2, deepep_mode="auto", **PARALLEL)
    outs, report = online._serve(skewed_fp8, eplb_debug_fail=fail, **flags, **EPLB)
    assert [o["output_ids"] for o in outs] == _without_eplb(skewed_fp8, **flags)
    assert report.rebalances == 0 and report.balancedness < 0.6  # rank 0 still holds both hot experts


@pytest.mark.slow
def test_fp8_rebalance_in_rounds_under_the_staging_cap(skewed_fp8):
    """--eplb-staging-max-mb below the plan's staging: it runs in rounds (no layers-per-chunk flag: the cap cuts
    the chunks), never above the cap, with the same tokens."""
    flags = dict(tp_size=2, dp_size=2, deepep_mode="auto", **PARALLEL)
    cap_mb = 1.5  # a layer's moves stage about 1.1 MiB (an expert ~200 KB in e4m3 + scales, incoming and spare)
    outs, report = online._serve(skewed_fp8, enable_eplb=True, eplb_rebalance_num_iterations=3,
                                 eplb_staging_max_mb=cap_mb, **flags)
    assert [o["output_ids"] for o in outs] == _without_eplb(skewed_fp8, **flags)
    assert report.staging_max_bytes == int(cap_mb * 2**20)
    assert 0 < report.peak_staged_bytes <= report.staging_max_bytes
    assert report.rebalances >= 1 and report.num_stalls >= 2 and report.balancedness >= 0.9
