"""The static-shape extend agreement and padding (moeserve/rank/static_extend.py), against plain references: the
agreed count, which ranks can pad, the padded batch, and the padded forward against the eager model's on one
rank (extend, prefix hit, mixed, decode and idle steps, the MLA and the GQA models), the KV pool outside the
step's own slots and the scratch page left as it was."""

from __future__ import annotations

import random

import pytest
import torch

from moeserve.args import ServerArgs
from moeserve.core.forward_batch import DECODE_LEN, ForwardBatch, ForwardMode
from moeserve.kvcache.kv_pool import kv_buffers
from moeserve.rank.piecewise_graph_runner import PiecewiseGraphRunner, token_buckets
from moeserve.rank.rank_sync import StepHeader
from moeserve.rank.static_extend import forward_padded, pad_extend, padded_extend_size, static_extend_ready
from tests.checkpoints import VOCAB, build_checkpoint
from tests.rank.inprocess import InProcessEngine


def test_padded_extend_size_is_the_smallest_bucket_holding_the_largest_group():
    rng = random.Random(49)
    for _ in range(300):
        buckets = token_buckets(rng.randrange(1, 5000))
        groups = [rng.randrange(0, buckets[-1] + 20) for _ in range(rng.randrange(1, 6))]
        top = max(groups)
        want = min((b for b in buckets if b >= top), default=None) if top else None
        assert padded_extend_size(groups, buckets) == want, (groups, buckets)
        header = StepHeader(groups, True, False, [0] * len(groups), all_static_extend=True)
        assert header.padded_extend_size(buckets) == want
        # no group prefills (a decode step: rank/static_shape.py), or a rank that cannot pad: no agreed count
        assert StepHeader(groups, False, False, [0] * len(groups), all_static_extend=True
                          ).padded_extend_size(buckets) is None
        assert StepHeader(groups, True, False, [0] * len(groups)).padded_extend_size(buckets) is None
        # the decode agreement is a different one: a prefill anywhere turns it off
        assert header.padded_decode_size([1, 2, 4]) is None


def _batch(mode: ForwardMode, lens: list[tuple[int, int]], rng: random.Random, num_decodes: int = 0,
           pool=None, slots: list[list[int]] | None = None) -> ForwardBatch:
    """A batch of requests (seq_len, extend_len) with random tokens; slots: each request's cache slots (default:
    fresh ones from 1 on)."""
    if slots is None:
        at, slots = 1, []
        for s, _ in lens:
            slots.append(list(range(at, at + s)))
            at += s
    ids = [rng.randrange(2, VOCAB) for _, e in lens for _ in range(e)]
    out = [x for (s, e), sl in zip(lens, slots, strict=True) for x in sl[s - e:s]]
    return ForwardBatch.build(mode, ids, [s for s, _ in lens], [e for _, e in lens], out,
                              [x for (s, _), sl in zip(lens, slots, strict=True) for x in sl[:s]], pool,
                              num_decodes=num_decodes)


def test_static_extend_ready_takes_extend_mixed_decode_and_idle_steps_up_to_the_largest_bucket():
    rng = random.Random(3)
    assert static_extend_ready(None, 16) and static_extend_ready(ForwardBatch.idle(), 16)
    assert static_extend_ready(_batch(ForwardMode.EXTEND, [(9, 9), (12, 7)], rng), 16)
    assert not static_extend_ready(_batch(ForwardMode.EXTEND, [(9, 9), (12, 8)], rng), 16)  # 17 tokens
    assert static_extend_ready(_batch(ForwardMode.MIXED, [(9, 9), (12, DECODE_LEN)], rng, num_decodes=1), 16)
    assert static_extend_ready(_batch(ForwardMode.DECODE, [(9, DECODE_LEN)] * 3, rng), 16)


def test_pad_extend_keeps_the_real_tokens_first_and_pads_into_the_scratch_slot():
    rng = random.Random(11)
    fb = _batch(ForwardMode.MIXED, [(14, 6), (20, 20), (9, DECODE_LEN)], rng, num_decodes=1)
    t = fb.num_tokens
    out = pad_extend(fb, 32, groups=2)
    assert out.mode is ForwardMode.EXTEND and out.num_tokens == 32 and out.global_num_tokens == [32, 32]
    for name in ("input_ids", "positions", "out_cache_loc"):
        assert torch.equal(getattr(out, name)[:t], getattr(fb, name)), name
        assert not getattr(out, name)[t:].any(), name  # token 0 at position 0, cached in the scratch slot 0
    assert out.seq_lens_cpu == out.extend_lens_cpu == [32] and out.prefix_lens_cpu == [0]
    idle = pad_extend(ForwardBatch.idle(), 8, groups=2)
    assert idle.num_tokens == 8 and not idle.input_ids.any() and not idle.out_cache_loc.any()


def _scratch_page(pool) -> int:
    return pool.page_size  # slots [0, page_size) are the scratch page, which no request owns


def _check_padded(model, pool, fb: ForwardBatch, size: int) -> None:
    """The padded step's logits are the eager step's (run first: it writes the step's KV), and it writes no slot
    but the step's own (the same values) and the scratch page's."""
    with torch.inference_mode():
        want = model(fb)
        before = [b.clone() for b in kv_buffers(pool)]
        got = forward_padded(model, fb, size, groups=1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    keep = torch.ones(before[0].shape[0], dtype=torch.bool)
    keep[:_scratch_page(pool)] = False
    keep[fb.out_cache_loc] = False
    for old, new in zip(before, kv_buffers(pool), strict=True):
        assert torch.equal(old[keep], new[keep])
        torch.testing.assert_close(new[fb.out_cache_loc], old[fb.out_cache_loc], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["v3_groups", "mixtral"])
def test_the_padded_forward_gives_the_eager_logits(tmp_path, name):
    eng = InProcessEngine(model_path=build_checkpoint(name, tmp_path / name), dtype="float32", device="cpu")
    model, pool = eng.runner.model, eng.runner.kv_pool
    rng = random.Random(5)
    a = list(range(1, 31))  # request A's slots (30 tokens at most), B's after them
    b = list(range(31, 61))
    # a prefill of two prompts
    _check_padded(model, pool, _batch(ForwardMode.EXTEND, [(5, 5), (9, 9)], rng, pool=pool, slots=[a, b]), 16)
    # a prefix hit: A goes on with 4 tokens after its 5 cached ones
    _check_padded(model, pool, _batch(ForwardMode.EXTEND, [(9, 4)], rng, pool=pool, slots=[a]), 8)
    # a mixed step: A's next chunk beside B's decode
    mixed = _batch(ForwardMode.MIXED, [(15, 6), (9 + DECODE_LEN, DECODE_LEN)], rng, num_decodes=1, pool=pool,
                   slots=[a, b])
    _check_padded(model, pool, mixed, 24)
    # both decode (a group decoding beside another group's prefill pads the same way)
    _check_padded(model, pool, _batch(ForwardMode.DECODE, [(15 + DECODE_LEN, DECODE_LEN),
                                                           (9 + 2 * DECODE_LEN, DECODE_LEN)], rng, pool=pool,
                                      slots=[a, b]), 8)
    # an idle group: padding rows only, no logits, nothing written but the scratch slot
    before = [x.clone() for x in kv_buffers(pool)]
    with torch.inference_mode():
        logits = forward_padded(model, ForwardBatch.idle(pool), 8, groups=1)
    assert logits.shape[0] == 0
    for old, new in zip(before, kv_buffers(pool), strict=True):
        assert torch.equal(old[_scratch_page(pool):], new[_scratch_page(pool):])
        assert torch.isfinite(new).all()


def test_the_piecewise_runner_takes_several_groups_only_at_the_agreed_count():
    runner = PiecewiseGraphRunner.__new__(PiecewiseGraphRunner)  # (its buffers and stream need a GPU)
    runner.max_tokens, runner.groups = 16, 1
    fb = _batch(ForwardMode.EXTEND, [(9, 9)], random.Random(2))
    fb.global_num_tokens = [9]
    assert runner.can_run(fb)  # one group: any extend step up to the largest bucket
    fb.global_num_tokens = [9, 4]
    assert not runner.can_run(fb)  # several groups, the flag off
    runner.groups = 2
    assert not runner.can_run(fb)  # no count agreed
    fb.static_num_tokens = 16
    assert runner.can_run(fb)
    idle = ForwardBatch.idle()
    idle.global_num_tokens, idle.static_num_tokens = [9, 0], 16
    assert runner.can_run(idle)  # an idle group runs the padding rows


def test_the_flag_is_refused_where_it_would_do_nothing():
    with pytest.raises(ValueError, match="--enable-static-shape-extend"):
        ServerArgs.from_kwargs(model_path="x", tp_size=2, enable_static_shape_extend=True)  # one DP group
    dp = dict(model_path="x", tp_size=2, dp_size=2, enable_dp_attention=True, enable_static_shape_extend=True)
    assert ServerArgs.from_kwargs(**dp).enable_static_shape_extend
    from moeserve.rank.speculative.support import unsupported_with_speculation

    assert "--enable-static-shape-extend" in unsupported_with_speculation(ServerArgs.from_kwargs(**dp))
