"""Two-batch overlap: the split of a ForwardBatch into two micro-batches, the per-step decision, the stage order.

Split invariants on random DECODE and EXTEND batches (prefixes, one-token and long prompts): every new token in
exactly one micro-batch, in order (A = first ceil(T/2) tokens); each micro-batch a consistent ForwardBatch
(positions continue each prefix, qo/kv indptrs, kv_indices = the request's slots, out_cache_loc = the slots of the
new positions, decode_slots rows); a MIXED batch's decodes (its last requests) split as a tail of each micro-batch,
and its extend and decode parts are consistent batches; a prompt cut in two continues in B; the micro-batch headers are exact; merging
A's and B's rows (hidden states and default logits rows) gives the parent's.
"""

from __future__ import annotations

import random

import pytest
import torch

from moeserve.core.forward_batch import ForwardBatch, ForwardMode
from moeserve.core.tbo_split import merge_rows, micro_headers, should_use_tbo, split_batch, split_point
from moeserve.models.tbo import execute_overlapped


def random_batch(rng: random.Random, mode: ForwardMode, num_reqs: int, with_slots: bool = False,
                 all_logits: bool = False) -> ForwardBatch:
    seq_lens, ext = [], []
    num_decodes = rng.randint(0, num_reqs) if mode.is_mixed else 0  # MIXED: the last ones decode
    for i in range(num_reqs):
        if mode.is_decode or i >= num_reqs - num_decodes:
            e = 1
            s = rng.randint(1, 40)
        else:
            e = rng.choice([1, 2, rng.randint(1, 50)])
            s = e + rng.choice([0, 0, rng.randint(1, 30)])
        seq_lens.append(s)
        ext.append(e)
    slots = rng.sample(range(1, 5000), sum(seq_lens))  # every request's slots, concatenated
    out_loc, ptr = [], 0
    for s, e in zip(seq_lens, ext, strict=True):
        out_loc.extend(slots[ptr + s - e: ptr + s])
        ptr += s
    ids = [rng.randrange(2, 500) for _ in range(sum(ext))]
    fb = ForwardBatch.build(mode, ids, seq_lens, ext, out_loc, slots, return_all_logits=all_logits,
                            num_decodes=num_decodes)
    if with_slots and (num_decodes or mode.is_decode):  # MIXED: rows of the decodes only
        first = num_reqs - num_decodes if mode.is_mixed else 0
        L = max(seq_lens[first:]) + 3
        block = torch.zeros(num_reqs - first, L, dtype=torch.int64)
        for b in range(first, num_reqs):
            k = fb.kv_indptr[b]
            block[b - first, :seq_lens[b]] = fb.kv_indices[k:k + seq_lens[b]]
        fb.decode_slots = block
    return fb


def check_consistent(fb: ForwardBatch) -> None:
    """The invariants the attention and the model read from a batch."""
    B = fb.batch_size
    assert fb.seq_lens.tolist() == fb.seq_lens_cpu and fb.extend_lens.tolist() == fb.extend_lens_cpu
    assert fb.prefix_lens.tolist() == fb.prefix_lens_cpu
    assert [s - e for s, e in zip(fb.seq_lens_cpu, fb.extend_lens_cpu, strict=True)] == fb.prefix_lens_cpu
    assert fb.qo_indptr.tolist() == [0, *torch.tensor(fb.extend_lens_cpu, dtype=torch.int64).cumsum(0).tolist()]
    # a decode's parts keep the parent's kv_indices and their own rows of kv_indptr (views only: capturable)
    k_first = fb.kv_indptr[0].item()
    assert k_first == 0 or fb.mode.is_decode
    assert fb.kv_indptr.tolist() == [k_first + x for x in
                                     [0, *torch.tensor(fb.seq_lens_cpu, dtype=torch.int64).cumsum(0).tolist()]]
    end = k_first + sum(fb.seq_lens_cpu)
    assert fb.kv_indices.shape[0] == end or (fb.mode.is_decode and fb.kv_indices.shape[0] > end)
    assert fb.num_tokens == sum(fb.extend_lens_cpu)
    for b in range(B):
        q0, q1 = fb.qo_indptr[b].item(), fb.qo_indptr[b + 1].item()
        k0 = fb.kv_indptr[b].item()
        p, s = fb.prefix_lens_cpu[b], fb.seq_lens_cpu[b]
        assert fb.positions[q0:q1].tolist() == list(range(p, s))
        assert fb.out_cache_loc[q0:q1].tolist() == fb.kv_indices[k0 + p:k0 + s].tolist()
        first = B - fb.num_decodes if fb.mode.is_mixed else 0  # decode_slots rows: requests first..B-1
        if fb.decode_slots is not None and b >= first:
            assert fb.decode_slots[b - first, :s].tolist() == fb.kv_indices[k0:k0 + s].tolist()
    if fb.mode.is_mixed:
        assert all(e == 1 for e in fb.extend_lens_cpu[B - fb.num_decodes:])
        assert fb.decode_slots is None or fb.decode_slots.shape[0] == fb.num_decodes
    if fb.logits_indices is not None:  # the last token of each request (but a request whose last token is in B)
        ends = [fb.qo_indptr[b + 1].item() - 1 for b in range(B)]
        assert fb.logits_indices.tolist() in (ends, ends[:-1])


def request_slots(fb: ForwardBatch) -> list[list[int]]:
    return [fb.kv_indices[fb.kv_indptr[b]:fb.kv_indptr[b + 1]].tolist() for b in range(fb.batch_size)]


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED])
def test_split_invariants_random(mode):
    rng = random.Random({ForwardMode.DECODE: 7, ForwardMode.EXTEND: 8}.get(mode, 9))
    for trial in range(300):
        n = rng.randint(1, 9)
        fb = random_batch(rng, mode, n, with_slots=mode is not ForwardMode.EXTEND and trial % 2 == 0,
                          all_logits=trial % 5 == 0)
        fb.global_num_tokens = [fb.num_tokens, rng.randint(0, 60)]
        fb.any_extend = True if trial % 3 == 0 else mode.is_extend
        a, b = split_batch(fb)
        s = split_point(fb.num_tokens)
        assert a.num_tokens == s and b.num_tokens == fb.num_tokens - s
        # every token exactly once, in order
        for name in ("input_ids", "positions", "out_cache_loc"):
            assert torch.equal(torch.cat([getattr(a, name), getattr(b, name)]), getattr(fb, name)), name
        ha, hb = micro_headers(fb.global_num_tokens)
        assert (a.global_num_tokens, b.global_num_tokens) == (ha, hb)
        assert [x + y for x, y in zip(ha, hb, strict=True)] == fb.global_num_tokens
        assert a.any_extend == b.any_extend == fb.any_extend
        parent_slots = request_slots(fb)
        for part in (a, b):
            assert part.kv_pool is fb.kv_pool and part.return_all_logits == fb.return_all_logits
            if part.num_tokens == 0:
                assert part.mode.is_idle
                continue
            assert part.mode == fb.mode
            check_consistent(part)
        # requests: A's whole ones, then (maybe) one cut in two, then B's whole ones
        cut = (a.batch_size + b.batch_size) == fb.batch_size + 1
        assert a.batch_size + b.batch_size in (fb.batch_size, fb.batch_size + 1)
        if cut:
            assert mode.is_extend
            assert a.seq_lens_cpu[-1] == b.prefix_lens_cpu[0]  # B's part continues A's
            assert a.prefix_lens_cpu[-1] + a.extend_lens_cpu[-1] + b.extend_lens_cpu[0] == b.seq_lens_cpu[0]
        a_slots, b_slots = request_slots(a), request_slots(b)
        merged = a_slots[:-1] + b_slots if cut else a_slots + b_slots
        assert merged == parent_slots
        if cut:
            assert b_slots[0][:len(a_slots[-1])] == a_slots[-1]
        if mode.is_decode:
            assert a.batch_size == (fb.batch_size + 1) // 2  # a split by sequences
        if mode.is_mixed:  # each part holds a tail of the decodes, A's before B's
            assert a.num_decodes + b.num_decodes == fb.num_decodes
            assert b.num_decodes == min(fb.num_decodes, b.batch_size)
            if fb.decode_slots is not None and fb.num_decodes:
                parts = [p.decode_slots for p in (a, b) if p.num_decodes]
                assert torch.equal(torch.cat(parts), fb.decode_slots)
        # merge = identity: per-token rows, and the default logits rows
        h = torch.randn(fb.num_tokens, 3)
        assert torch.equal(merge_rows(fb, h[:s], h[s:]), h)
        if not fb.return_all_logits:
            la = a.logits_indices.tolist() if a.num_tokens else []
            lb = [x + s for x in b.logits_indices.tolist()] if b.num_tokens else []
            assert la + lb == fb.logits_indices.tolist()
        else:
            assert a.logits_indices is None or a.num_tokens == 0


def test_mixed_parts_random():
    """A MIXED batch's extend and decode parts: consistent batches of their own, together the parent's tokens."""
    rng = random.Random(10)
    for trial in range(200):
        fb = random_batch(rng, ForwardMode.MIXED, rng.randint(1, 9), with_slots=trial % 2 == 0)
        ext, dec = fb.mixed_parts()
        assert (ext.mode, dec.mode) == (ForwardMode.EXTEND, ForwardMode.DECODE)
        assert (ext.batch_size, dec.batch_size) == (fb.batch_size - fb.num_decodes, fb.num_decodes)
        for name in ("input_ids", "positions", "out_cache_loc", "kv_indices"):
            assert torch.equal(torch.cat([getattr(ext, name), getattr(dec, name)]), getattr(fb, name)), name
        for part in (ext, dec):
            part.logits_indices = None
            check_consistent(part)
        assert request_slots(ext) + request_slots(dec) == request_slots(fb)


def test_split_edge_cases():
    idle = ForwardBatch.idle()
    idle.global_num_tokens, idle.any_extend = [0, 7], True
    a, b = split_batch(idle)
    assert a.mode.is_idle and b.mode.is_idle and a.num_tokens == b.num_tokens == 0
    assert (a.global_num_tokens, b.global_num_tokens) == ([0, 4], [0, 3]) and a.any_extend and b.any_extend
    # one decode request: A has it, B is IDLE
    fb = ForwardBatch.build(ForwardMode.DECODE, [5], [3], [1], [12], [10, 11, 12])
    a, b = split_batch(fb)
    assert a.batch_size == 1 and b.mode.is_idle
    # one prompt of 5 tokens after a prefix of 2: A gets positions 2..4, B 5..6 with prefix 5
    fb = ForwardBatch.build(ForwardMode.EXTEND, [1, 2, 3, 4, 5], [7], [5], [3, 4, 5, 6, 7], list(range(1, 8)))
    a, b = split_batch(fb)
    assert a.positions.tolist() == [2, 3, 4] and b.positions.tolist() == [5, 6]
    assert (a.prefix_lens_cpu, a.seq_lens_cpu, b.prefix_lens_cpu, b.seq_lens_cpu) == ([2], [5], [5], [7])
    assert a.kv_indices.tolist() == [1, 2, 3, 4, 5] and b.kv_indices.tolist() == list(range(1, 8))
    assert a.logits_indices.tolist() == [] and b.logits_indices.tolist() == [1]


def test_decision_is_the_same_on_every_rank():
    fb = ForwardBatch.idle()
    fb.global_num_tokens = [0, 100]
    assert should_use_tbo(fb, True, 64, world_size=2)  # the idle rank overlaps too (two IDLE micro-batches)
    assert not should_use_tbo(fb, False, 64, world_size=2)
    fb.global_num_tokens = [10, 63]
    assert not should_use_tbo(fb, True, 64, world_size=2)
    fb.global_num_tokens = None
    assert not should_use_tbo(fb, True, 0, world_size=2)  # no header on several ranks: never
    one = ForwardBatch.build(ForwardMode.DECODE, [5, 6], [3, 4], [1, 1], [2, 6], list(range(7)))
    assert should_use_tbo(one, True, 2) and not should_use_tbo(one, True, 3)


def test_executor_order():
    """A's dispatch is in flight while B runs attention; A's combine while A runs its shared experts."""
    log: list[str] = []

    def layer(i: int, moe: bool):
        def stages(name: str):
            log.append(f"{name}{i}:attn")
            if not moe:
                return
            log.append(f"{name}{i}:dispatch_a")
            yield
            log.append(f"{name}{i}:dispatch_b+experts+combine_a")
            yield
            log.append(f"{name}{i}:shared+combine_b")
        return stages

    layers = [layer(0, False), layer(1, True), layer(2, True)]

    def program(name):
        for st in layers:
            yield from st(name)

    execute_overlapped([program("A"), program("B")])
    assert log == [
        "A0:attn", "A1:attn", "A1:dispatch_a", "B0:attn", "B1:attn", "B1:dispatch_a",
        "A1:dispatch_b+experts+combine_a", "B1:dispatch_b+experts+combine_a",
        "A1:shared+combine_b", "A2:attn", "A2:dispatch_a", "B1:shared+combine_b", "B2:attn", "B2:dispatch_a",
        "A2:dispatch_b+experts+combine_a", "B2:dispatch_b+experts+combine_a",
        "A2:shared+combine_b", "B2:shared+combine_b",
    ]


def test_decode_split_is_capturable(monkeypatch):
    """A decode batch with its slot block splits from views and device arithmetic alone: no host tensor is built
    and nothing is copied to the device, which is what lets a captured (CUDA-graph) decode step overlap its halves.
    A batch of one gives an IDLE B made on the batch's device."""
    rng = random.Random(11)
    batches = [random_batch(rng, ForwardMode.DECODE, n, with_slots=True) for n in (1, 2, 5, 8)]
    for fb in batches:
        fb.global_num_tokens = [fb.num_tokens, 3]

    def no_host_tensor(*args, **kwargs):
        raise AssertionError("the decode split built a host tensor")

    monkeypatch.setattr(torch, "tensor", no_host_tensor)
    for fb in batches:
        a, b = split_batch(fb)
        for part in (a, b):
            if part.mode.is_idle:
                assert fb.batch_size == 1 and part is b
                continue
            for name in ("input_ids", "positions", "out_cache_loc", "seq_lens", "decode_slots", "kv_indices"):
                mine, parent = getattr(part, name), getattr(fb, name)
                assert mine.untyped_storage().data_ptr() == parent.untyped_storage().data_ptr(), name
