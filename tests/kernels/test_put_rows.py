"""put_rows (the counted row put of the symmetric-memory dispatcher): Triton (interpreted on CPU) against the
torch reference, on strided destinations, with an index and without, and counts of 0, some and all rows."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.put_rows import put_rows_reference


@pytest.mark.parametrize("dtype", [torch.int32, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_index", [True, False])
@pytest.mark.parametrize("count", [0, 3, 7])
def test_put_rows_matches_reference(device, dtype, with_index, count):
    from moeserve.kernels.triton_ops.put_rows import put_rows

    gen = torch.Generator().manual_seed(count + 10 * with_index)
    src = (torch.randn(9, 40, generator=gen) * 1000).to(dtype)
    index = torch.randperm(9, generator=gen)[:7] if with_index else None
    n = torch.tensor([count], dtype=torch.int32)
    wide = torch.full((7, 56), -5, dtype=dtype)  # dst: a column slice of a wider buffer, the rest must stay
    want = wide.clone()
    put_rows_reference(src, index, n, want[:, 8:48])
    got = wide.to(device)
    put_rows(src.to(device), None if index is None else index.to(device), n.to(device), got[:, 8:48])
    assert torch.equal(got.cpu(), want)
    assert torch.equal(want[count:], torch.full((7 - count, 56), -5, dtype=dtype))
