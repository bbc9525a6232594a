"""--ep-dispatch-algorithm fake: on a router skewed onto a few experts, the recorded per-expert counts are near
uniform (a chi-square bound), while the same model without fake keeps the skew; /get_server_info says fake."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from moeserve.args import ServerArgs
from moeserve.eplb.recorder import ExpertDistributionRecorder
from moeserve.server.http.info import get_server_info
from tests.models.harness import Runner, random_tokens

TOKENS = 600


def _counts(tiny_checkpoint, algorithm: str) -> tuple[torch.Tensor, int]:
    """[MoE layers, experts] tokens recorded over one extend of TOKENS tokens with every gate's bias pushing all
    tokens onto the first k experts; and k."""
    runner = Runner(tiny_checkpoint("v3_no_q_lora"), ep_dispatch_algorithm=algorithm)
    cfg = runner.config
    for moe in runner.model.moe_layers():
        with torch.no_grad():
            moe.gate.e_score_correction_bias.zero_()
            moe.gate.e_score_correction_bias[:cfg.num_experts_per_tok] = 100.0  # the skew: these always win
    rec = ExpertDistributionRecorder(cfg.moe_layers, cfg.num_experts, "cpu")
    runner.model.set_expert_recorder(rec)
    rec.start()
    torch.manual_seed(0)
    runner.extend([("a", random_tokens(TOKENS, 1))])
    return rec.window(), cfg.num_experts_per_tok


def test_fake_routes_uniformly_on_a_skewed_router(tiny_checkpoint):
    skewed, k = _counts(tiny_checkpoint, "static")
    assert (skewed[:, :k] == TOKENS).all() and (skewed[:, k:] == 0).all()
    fake, _ = _counts(tiny_checkpoint, "fake")
    num_experts = fake.shape[1]
    assert (fake.sum(1) == TOKENS * k).all()
    expected = TOKENS * k / num_experts
    chi2 = ((fake - expected) ** 2 / expected).sum(1)  # per layer, about chi-square with E - 1 degrees of freedom
    df = num_experts - 1
    assert (chi2 < df + 6 * (2 * df) ** 0.5).all(), chi2


@pytest.mark.parametrize("algorithm", ["static", "fake"])
def test_server_info_says_fake(algorithm):
    args = ServerArgs(model_path="/models/fake", ep_dispatch_algorithm=algorithm)
    ctx = SimpleNamespace(client=SimpleNamespace(server_args=args, weight_format="bf16", last_load=[]),
                          model_name="m", context_length=16, kv_capacity=16)
    info = asyncio.run(get_server_info(ctx))
    assert info["ep_dispatch_algorithm"] == algorithm
    assert ("fake_dispatch" in info) == (algorithm == "fake")
    if algorithm == "fake":
        assert "meaningless" in info["fake_dispatch"]
