"""Routing helpers against plain-Python versions (seeded hypothesis), and the low-latency path's static shapes.

The low-latency dispatcher runs here on the `meta` device with the collectives replaced by copies: a meta tensor
has no data, so any host read of device data (`.item()`, `.tolist()`, `nonzero`, boolean indexing) raises. That is
the property CUDA-graph capture needs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from moeserve.core.forward_batch import ForwardBatch
from moeserve.core.layouts import MaskedLayout
from moeserve.ep.all2all import All2AllDispatcher, resolve_deepep_mode
from moeserve.ep.all2all_low_latency import LowLatencyDispatcher
from moeserve.ep.routing import (
    aligned_offsets,
    combine_contiguous,
    combine_masked,
    dedupe_topk,
    local_topk,
    num_local_experts,
    pack_meta,
    plan_contiguous,
    plan_masked,
    scatter_contiguous,
    scatter_masked,
    token_rank_mask,
    unpack_meta,
)

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)


@st.composite
def routings(draw):
    """(ids [N, k] int64 in [-1, E), weights [N, k] fp32, E, R) with E a multiple of R."""
    r = draw(st.integers(1, 4))
    e = r * draw(st.integers(1, 4))
    n, k = draw(st.integers(0, 12)), draw(st.integers(1, 5))
    ids = draw(st.lists(st.integers(-1, e - 1), min_size=n * k, max_size=n * k))
    weights = draw(st.lists(st.floats(0.0, 2.0, width=32), min_size=n * k, max_size=n * k))
    return torch.tensor(ids, dtype=torch.int64).view(n, k), torch.tensor(weights).view(n, k), e, r


@SETTINGS
@given(routings())
def test_token_rank_mask_and_local_topk(case) -> None:
    ids, weights, e, r = case
    el = e // r
    mask = token_rank_mask(ids, el, r)
    for n in range(ids.shape[0]):
        assert mask[n].tolist() == [any(0 <= i // el == rank for i in ids[n].tolist() if i >= 0) for rank in range(r)]
    for rank in range(r):
        local, w = local_topk(ids, weights, rank, el)
        mine = (ids >= rank * el) & (ids < (rank + 1) * el)
        assert torch.equal(local, torch.where(mine, ids - rank * el, -1))
        assert torch.equal(w, torch.where(mine, weights, 0.0))


@SETTINGS
@given(routings(), st.integers(1, 5), st.booleans())
def test_plan_contiguous_matches_python(case, align: int, static: bool) -> None:
    ids, weights, e, _ = case  # as if one rank held all E experts
    h = 3
    rows = torch.randn(ids.shape[0], h, generator=torch.Generator().manual_seed(ids.numel()))
    plan = plan_contiguous(ids, weights, e, align, static=static)
    layout = scatter_contiguous(rows, plan)
    expected_pairs = {x: [(n, j) for n in range(ids.shape[0]) for j in range(ids.shape[1]) if ids[n, j] == x]
                      for x in range(e)}
    counts = [len(expected_pairs[x]) for x in range(e)]
    assert layout.num_tokens_per_expert.tolist() == counts
    assert torch.equal(layout.expert_offsets.long(), aligned_offsets(torch.tensor(counts), align))
    end = int(layout.expert_offsets[-1])
    assert layout.x.shape == (ids.numel() + e * (align - 1) if static else end, h)
    assert not layout.x[end:].any()  # static: the rows past the last segment are zero
    for x in range(e):  # each segment: that expert's pairs in (row, slot) order, then zero padding
        lo, hi = int(layout.expert_offsets[x]), int(layout.expert_offsets[x + 1])
        want = [rows[n] for n, _ in expected_pairs[x]]
        got = layout.x[lo : lo + counts[x]]
        assert torch.equal(got, torch.stack(want) if want else got)
        assert not layout.x[lo + counts[x] : hi].any()
    out = torch.randn_like(layout.x)
    out[end:] = float("nan")  # never read
    want = torch.zeros(ids.shape[0], h)
    for x in range(e):
        lo = int(layout.expert_offsets[x])
        for i, (n, j) in enumerate(expected_pairs[x]):
            want[n] += weights[n, j] * out[lo + i]
    torch.testing.assert_close(combine_contiguous(out, plan, ids.shape[0]), want)


@SETTINGS
@given(routings(), st.integers(0, 3))
def test_plan_masked_matches_python(case, already: int) -> None:
    ids, weights, e, _ = case
    n, h = ids.shape[0], 3
    capacity = n + already
    rows = torch.randn(n, h, generator=torch.Generator().manual_seed(ids.numel()))
    filled = torch.full((e,), already, dtype=torch.int64)
    plan = plan_masked(ids, weights, e, capacity, filled)
    x_flat = torch.zeros(e * capacity + 1, h)
    scatter_masked(rows, plan, x_flat)
    x = x_flat[:-1].view(e, capacity, h)
    out = torch.randn(e, capacity, h)
    out_want = torch.zeros(n, h)
    for x_id in range(e):
        tokens = [t for t in range(n) if x_id in ids[t].tolist()]  # one row per distinct (token, expert)
        assert int(filled[x_id]) == already + len(tokens)
        for i, t in enumerate(tokens):
            assert torch.equal(x[x_id, already + i], rows[t])
            merged = weights[t][ids[t] == x_id].sum()
            out_want[t] += merged * out[x_id, already + i]
    out[:, :already] = float("nan")  # rows that belong to earlier rounds are never read
    torch.testing.assert_close(combine_masked(out.view(-1, h), plan), out_want)


def test_dedupe_merges_repeats() -> None:
    ids = torch.tensor([[2, 2, -1, 1, 2]])
    w = torch.tensor([[0.5, 0.25, 9.0, 1.0, 0.125]])
    valid, merged = dedupe_topk(ids, w)
    assert valid.tolist() == [[True, False, False, True, False]]
    assert merged.tolist() == [[0.875, 0.0, 0.0, 1.0, 0.0]]


def test_meta_roundtrip_and_offsets() -> None:
    ids = torch.tensor([[3, -1], [0, 7]])
    w = torch.tensor([[0.5, -2.0], [float("inf"), 1e-30]])
    back_ids, back_w = unpack_meta(pack_meta(ids, w))
    assert torch.equal(back_ids, ids) and torch.equal(back_w, w)
    assert aligned_offsets(torch.tensor([0, 1, 4, 5]), 4).tolist() == [0, 0, 4, 8, 16]


def test_experts_must_split_over_ranks() -> None:
    assert num_local_experts(64, 8) == 8
    with pytest.raises(ValueError, match="ep-size"):
        num_local_experts(10, 4)


def test_resolve_deepep_mode() -> None:
    extend = dataclasses.replace(ForwardBatch.idle(), any_extend=True)
    decode = ForwardBatch.idle()
    assert resolve_deepep_mode("auto", extend) == "normal"
    assert resolve_deepep_mode("auto", decode) == "low_latency"
    assert resolve_deepep_mode("auto", None) == "low_latency"
    assert resolve_deepep_mode("normal", decode) == "normal"
    assert resolve_deepep_mode("low_latency", extend) == "low_latency"
    with pytest.raises(ValueError, match="deepep-mode"):
        resolve_deepep_mode("fast", decode)
    with pytest.raises(ValueError, match="deepep-mode"):
        All2AllDispatcher(num_experts=4, hidden_size=8, topk=2, dtype=torch.float32, device="cpu", ep_group=None,
                          ep_rank=0, ep_size=1, deepep_mode="fast")


# ---------------------------------------------------------------------------------------------------------------
# Low latency: static shapes, no host reads


class _Done:
    def wait(self) -> None:
        pass


def _copy_all_to_all(output, input, *args, **kwargs):  # noqa: A002 - torch's own parameter name
    output.copy_(input)  # as if every rank sent what this one did: enough for shapes and host reads
    return _Done()


@pytest.mark.parametrize(("tokens", "rounds"), [(5, 1), (8, 1), (19, 3), (0, 1)])
def test_low_latency_has_no_host_reads(monkeypatch, tokens: int, rounds: int) -> None:
    monkeypatch.setattr(dist, "all_to_all_single", _copy_all_to_all)
    r, e, h, k, cap = 4, 8, 16, 3, 8
    disp = LowLatencyDispatcher(num_experts=e, hidden_size=h, topk=k, dtype=torch.bfloat16, device="meta",
                                ep_group=None, ep_rank=1, ep_size=r, max_tokens_per_rank=cap)
    assert disp.buffer_bytes() == 2 * r * cap * (h * 2 + 2 * k * 4)
    assert disp.layout_bytes(rounds) == (e // r) * rounds * r * cap * h * 2
    batch = dataclasses.replace(ForwardBatch.idle(), global_num_tokens=[tokens, 3, 0, 1])
    x = torch.empty(tokens, h, dtype=torch.bfloat16, device="meta")
    ids = torch.empty(tokens, k, dtype=torch.int64, device="meta")
    weights = torch.empty(tokens, k, dtype=torch.float32, device="meta")
    for _ in range(2):  # the same instance serves step after step
        disp.dispatch_a(x, ids, weights, batch)
        layout = disp.dispatch_b()
        assert isinstance(layout, MaskedLayout)
        assert layout.x.shape == (e // r, rounds * r * cap, h) and layout.x.device.type == "meta"
        assert layout.masked_m.shape == (e // r,) and layout.masked_m.dtype == torch.int32
        disp.combine_a(torch.empty_like(layout.x))
        out = disp.combine_b()
        assert out.shape == x.shape and out.dtype == x.dtype


def test_static_contiguous_plan_has_no_host_reads() -> None:
    n, k, e, h, align = 6, 3, 4, 8, 4
    ids = torch.empty(n, k, dtype=torch.int64, device="meta")
    weights = torch.empty(n, k, device="meta")
    plan = plan_contiguous(ids, weights, e, align, static=True)
    layout = scatter_contiguous(torch.empty(n, h, device="meta"), plan)
    assert layout.x.shape == (n * k + e * (align - 1), h) and layout.expert_offsets.shape == (e + 1,)
    assert combine_contiguous(torch.empty_like(layout.x), plan, n).shape == (n, h)
