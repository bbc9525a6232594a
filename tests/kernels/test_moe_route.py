"""moe_route's Triton kernel against its torch reference (a stable argsort): exact equality of every output."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.moe_route import moe_route_reference


def _check(ids: torch.Tensor, num_experts: int, align: int, all_valid: bool = False) -> None:
    from moeserve.kernels.triton_ops.moe_route import moe_route

    got, ref = moe_route(ids, num_experts, align, all_valid), moe_route_reference(ids, num_experts, align)
    assert got.num_rows == ref.num_rows
    for name in ("counts", "offsets", "dest", "src"):
        torch.testing.assert_close(getattr(got, name).long(), getattr(ref, name).long(), rtol=0, atol=0, msg=name)
    # the plan is a permutation: each valid pair's row holds that pair
    valid = (ids.reshape(-1) >= 0).nonzero().squeeze(1)
    assert torch.equal(got.src.long()[got.dest.long()[valid]], valid)


@pytest.mark.parametrize("num_tokens,k,num_experts,align", [
    (1, 1, 4, 1),  # a single token
    (5, 2, 3, 1),  # expert count not a power of two, most experts empty
    (37, 6, 64, 1),  # V2-Lite-shaped decode
    (300, 4, 16, 1),  # several blocks of pairs
    (29, 3, 8, 16),  # padded segments
])
@pytest.mark.parametrize("all_valid", [False, True])
def test_route_matches_reference(num_tokens, k, num_experts, align, all_valid, device):
    gen = torch.Generator().manual_seed(num_tokens * 31 + k)
    ids = torch.randint(0, num_experts, (num_tokens, k), generator=gen)
    _check(ids.to(device), num_experts, align, all_valid)  # all_valid: src not pre-filled, every row still named


def test_route_skips_masked_pairs_and_empty_experts(device):
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 3, (40, 4), generator=gen)  # experts 3..9 get no pairs
    ids[torch.rand(40, 4, generator=gen) < 0.3] = -1
    _check(ids.to(device), 10, 4)
    ids_all_masked = torch.full((3, 2), -1)
    _check(ids_all_masked.to(device), 5, 1)
