"""ForwardBatch.to: a batch's host tensors reach the device in one packed copy per dtype, as views in their shapes
and values, aligned; tensors already there and None fields stay as they are."""

from __future__ import annotations

import pytest
import torch

from moeserve.core.forward_batch import ALIGN, ForwardBatch, ForwardMode, packed_copy

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
def test_packed_copy_keeps_values_shapes_and_alignment(device):
    gen = torch.Generator().manual_seed(7)
    tensors = {"a": torch.randint(-5, 10**6, (37,), generator=gen), "empty": torch.zeros(0, dtype=torch.int64),
               "grid": torch.randint(0, 99, (3, 5), generator=gen), "f": torch.randn(4, 2, generator=gen),
               "b": torch.randint(0, 7, (1,), generator=gen)}
    out = packed_copy(tensors, torch.device(device))
    assert sorted(out) == sorted(tensors)
    for name, t in tensors.items():
        got = out[name]
        assert got.device.type == device and got.dtype == t.dtype and got.shape == t.shape
        torch.testing.assert_close(got.cpu(), t, rtol=0, atol=0)
        assert got.storage_offset() % ALIGN == 0
    assert out["a"].untyped_storage().data_ptr() == out["grid"].untyped_storage().data_ptr()  # one int64 buffer
    out["a"].add_(1)  # views do not overlap
    torch.testing.assert_close(out["grid"].cpu(), tensors["grid"], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_batch_to_moves_every_tensor(device):
    fb = ForwardBatch.build(ForwardMode.EXTEND, [5, 6, 7, 8, 9], [3, 2], [3, 2], [10, 11, 12, 20, 21],
                            [10, 11, 12, 20, 21])
    moved = fb.to(device)
    for name in ("input_ids", "positions", "seq_lens", "extend_lens", "prefix_lens", "out_cache_loc", "kv_indices",
                 "kv_indptr", "qo_indptr", "logits_indices"):
        torch.testing.assert_close(getattr(moved, name).cpu(), getattr(fb, name), rtol=0, atol=0)
        assert getattr(moved, name).device.type == device
    assert moved.decode_slots is None and moved.seq_lens_cpu == [3, 2]
    again = moved.to(device)
    assert again.input_ids is moved.input_ids  # already there: not copied again
