"""The static-shape decode agreement and padding (moeserve/rank/static_shape.py), against plain references."""

from __future__ import annotations

import random

import pytest
import torch

from moeserve.args import ServerArgs
from moeserve.core.forward_batch import DECODE_LEN, ForwardBatch, ForwardMode
from moeserve.rank.cuda_graph_runner import batch_buckets
from moeserve.rank.rank_sync import StepHeader
from moeserve.rank.static_shape import pad_decode, padded_size


def test_padded_size_is_the_smallest_bucket_holding_the_largest_group():
    rng = random.Random(49)
    for _ in range(200):
        buckets = batch_buckets(rng.randrange(1, 300))
        groups = [rng.randrange(0, buckets[-1] + 3) * DECODE_LEN for _ in range(rng.randrange(1, 6))]
        top = max(groups) // DECODE_LEN
        want = min((b for b in buckets if b >= top), default=None) if top else None
        assert padded_size(groups, buckets) == want, (groups, buckets)
        header = StepHeader(groups, False, False, [0] * len(groups), all_static=True)
        assert header.padded_decode_size(buckets) == want
        # a prefill anywhere, or a rank that cannot pad: the step runs eagerly
        assert StepHeader(groups, True, False, [0] * len(groups), all_static=True).padded_decode_size(buckets) is None
        assert StepHeader(groups, False, False, [0] * len(groups)).padded_decode_size(buckets) is None


def test_pad_decode_keeps_the_real_rows_and_pads_into_the_scratch_slot():
    rng = random.Random(7)
    seq = [rng.randrange(1, 20) for _ in range(3)]
    slots = [[rng.randrange(1, 500) for _ in range(n)] for n in seq]
    fb = ForwardBatch.build(ForwardMode.DECODE, [rng.randrange(2, 100) for _ in range(3 * DECODE_LEN)], seq,
                            [DECODE_LEN] * 3, [s[-1] for s in slots for _ in range(DECODE_LEN)],
                            [x for s in slots for x in s])
    fb.decode_slots = torch.tensor([s + [s[0]] * (max(seq) - len(s)) for s in slots])  # (as the scheduler pads)
    out = pad_decode(fb, 8, groups=2)
    assert torch.equal(out.decode_slots[:3], fb.decode_slots) and out.decode_slots.shape == (8, max(seq))
    assert not out.decode_slots[3:].any()
    assert out.batch_size == 8 and out.global_num_tokens == [8 * DECODE_LEN] * 2
    n = fb.num_tokens
    for name in ("input_ids", "positions", "out_cache_loc"):
        assert torch.equal(getattr(out, name)[:n], getattr(fb, name)), name
        assert not getattr(out, name)[n:].any(), name  # token 0 at position 0, written to slot 0
    assert torch.equal(out.kv_indices[: fb.kv_indices.numel()], fb.kv_indices)
    assert not out.kv_indices[fb.kv_indices.numel():].any()
    assert out.seq_lens_cpu[3:] == [DECODE_LEN] * 5 and out.kv_indptr.tolist()[:4] == fb.kv_indptr.tolist()
    assert torch.equal(out.logits_indices, fb.logits_indices)  # padding never reaches the LM head or sampling
    idle = pad_decode(ForwardBatch.idle(), 4, groups=2)
    assert idle.batch_size == 4 and idle.logits_indices.numel() == 0 and not idle.kv_indices.any()


def test_the_flag_is_refused_on_one_rank():
    with pytest.raises(ValueError, match="--enable-static-shape-decode"):
        ServerArgs.from_kwargs(model_path="x", enable_static_shape_decode=True)
    assert ServerArgs.from_kwargs(model_path="x", tp_size=2, enable_static_shape_decode=True).enable_static_shape_decode
