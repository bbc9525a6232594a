"""The dispatcher test suite: every backend and mode on CPU ranks (gloo), against identity experts and a dense
reference. test_ep_dispatch_2ranks.py and test_ep_dispatch_4ranks.py run it for 2 and 4 ranks.

One process group per world size runs every (scenario, backend) case and reports each check; the pytest cases
below only read those reports. Checks per case:
- identity: dispatch, identity experts, combine returns x * (sum of the token's valid weights);
- experts: per-expert tanh(x W + b) experts (shared seed) equal the single-process dense reference computed from all
  ranks' tokens; padding rows of the expert output are set to NaN first, so reading one would show;
- layout: ContiguousLayout segments per local expert, aligned, counts and rows as the routing says; MaskedLayout
  capacity, masked_m and rows as the routing says (one row per distinct (token, expert)).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch
from ep_harness import (
    Scenario,
    apply_expert,
    dense_reference,
    make_experts,
    make_inputs,
    run_ranks,
    with_header,
)

from moeserve.core.forward_batch import ForwardBatch
from moeserve.core.layouts import ContiguousLayout, MaskedLayout
from moeserve.ep.all2all import All2AllDispatcher
from moeserve.ep.all2all_low_latency import LowLatencyDispatcher
from moeserve.ep.all2all_normal import NormalDispatcher
from moeserve.ep.allgather import AllGatherDispatcher
from moeserve.ep.symm import SymmAll2AllDispatcher, SymmLowLatencyDispatcher

CAP = 8  # low-latency capacity per rank in these tests: small, so some scenarios need several rounds



@dataclass(frozen=True)
class Backend:
    cls: type
    kwargs: dict
    any_extend: bool  # the header's flag (auto resolves on it)
    header: bool = True  # False: no global_num_tokens, the dispatcher agrees on sizes by an all-reduce
    expect_mode: str | None = None  # All2AllDispatcher: the mode it must resolve to
    only: tuple[str, ...] | None = None  # run on these scenarios only


BACKENDS = {
    "allgather": Backend(AllGatherDispatcher, {"align": 1}, True),
    "allgather_align4": Backend(AllGatherDispatcher, {"align": 4}, True),
    "allgather_noheader": Backend(AllGatherDispatcher, {"align": 1}, True, header=False,
                                  only=("uniform", "over_cap_one_rank", "idle_ranks", "all_idle")),
    "normal": Backend(NormalDispatcher, {"align": 1}, True),
    "normal_align4": Backend(NormalDispatcher, {"align": 4}, True),
    "low_latency": Backend(LowLatencyDispatcher, {"max_tokens_per_rank": CAP}, False),
    "low_latency_noheader": Backend(LowLatencyDispatcher, {"max_tokens_per_rank": CAP}, False, header=False,
                                    only=("uniform", "over_cap_one_rank", "idle_ranks", "all_idle")),
    "symm": Backend(SymmLowLatencyDispatcher, {"max_tokens_per_rank": CAP}, False),
    "symm_noheader": Backend(SymmLowLatencyDispatcher, {"max_tokens_per_rank": CAP}, False, header=False,
                             only=("uniform", "over_cap_one_rank", "idle_ranks", "all_idle")),
    "symm_auto_decode": Backend(SymmAll2AllDispatcher, {"max_tokens_per_rank": CAP, "align": 2}, False,
                                expect_mode="low_latency"),
    "auto_prefill": Backend(All2AllDispatcher, {"max_tokens_per_rank": CAP, "align": 2}, True, expect_mode="normal"),
    "auto_decode": Backend(All2AllDispatcher, {"max_tokens_per_rank": CAP, "align": 2}, False,
                           expect_mode="low_latency"),
}


def scenarios(world: int) -> list[Scenario]:
    """Routings for `world` ranks, deterministic. E is a multiple of world."""
    def toks(*per_rank):  # cycle a pattern over the ranks
        return tuple(per_rank[r % len(per_rank)] for r in range(world))

    return [
        Scenario("uniform", toks(5, 17, 11, 3), 4 * world, 4, "uniform", seed=1),
        Scenario("uniform_k1_one_expert_per_rank", toks(6, 9), world, 1, "uniform", seed=2),
        Scenario("over_cap_one_rank", toks(3 * CAP + 1, 4, 0, 7), 2 * world, 3, "uniform", seed=3),
        Scenario("over_cap_all_ranks", toks(2 * CAP, 2 * CAP + 3), 2 * world, 2, "uniform", seed=4),
        Scenario("exactly_cap", toks(CAP), 2 * world, 2, "uniform", seed=5),
        Scenario("one_expert_all_slots", toks(7, 12, 0, 5), 2 * world, 4, "one_expert_all_slots", seed=6),
        Scenario("one_expert_first_slot", toks(10, 4), 2 * world, 3, "one_expert_first_slot", seed=7),
        Scenario("idle_ranks", toks(0, 9, 0, 13), 4 * world, 2, "uniform", seed=8),
        Scenario("all_idle", toks(0), 2 * world, 2, "uniform", seed=9),
        Scenario("same_rank_repeats", toks(9, 14, 5), 4 * world, 4, "same_rank", seed=10),
        Scenario("with_replacement_over_cap", toks(11, 2 * CAP + 5), 2 * world, 6, "with_replacement", seed=11),
        Scenario("masked_slots", toks(12, 6, 9), 4 * world, 4, "masked", seed=12),
        Scenario("bf16_uniform", toks(13, 7), 4 * world, 4, "uniform", seed=13, hidden=32, dtype="bfloat16"),
        Scenario("bf16_over_cap", toks(CAP + 3, 2), 2 * world, 3, "with_replacement", seed=14, dtype="bfloat16"),
    ]


# ---------------------------------------------------------------------------------------------------------------
# Inside each rank


def _build(backend: str, sc: Scenario, rank: int, world: int):
    cls = BACKENDS[backend].cls
    kwargs = dict(num_experts=sc.num_experts, hidden_size=sc.hidden, dtype=sc.torch_dtype, device="cpu",
                  ep_group=None, ep_rank=rank, ep_size=world, **BACKENDS[backend].kwargs)
    if issubclass(cls, (LowLatencyDispatcher, All2AllDispatcher)):
        kwargs["topk"] = sc.topk
    return cls(**kwargs)


def _run_experts(layout, sc: Scenario, rank: int, identity: bool) -> torch.Tensor:
    """This rank's experts on the layout; rows past the valid counts become NaN (must never be read)."""
    w_all, b_all = make_experts(sc)
    out = torch.full_like(layout.x, float("nan"))
    if isinstance(layout, ContiguousLayout):
        offs, counts = layout.expert_offsets.tolist(), layout.num_tokens_per_expert.tolist()
        segments = [(offs[e], offs[e] + counts[e]) for e in range(len(counts))]
        for e, (lo, hi) in enumerate(segments):
            g = rank * len(counts) + e
            out[lo:hi] = layout.x[lo:hi] if identity else apply_expert(layout.x[lo:hi], w_all[g], b_all[g])
    else:
        for e, m in enumerate(layout.masked_m.tolist()):
            g = rank * layout.x.shape[0] + e
            out[e, :m] = layout.x[e, :m] if identity else apply_expert(layout.x[e, :m], w_all[g], b_all[g])
    return out


def _expected_rows(sc: Scenario, inputs, expert: int, distinct: bool) -> torch.Tensor:
    """Rows routed to `expert` from every rank: one per pair, or one per token naming it when `distinct`."""
    rows = []
    for x, ids, _ in inputs:
        for t in range(x.shape[0]):
            hits = int((ids[t] == expert).sum())
            rows += [x[t]] * (min(hits, 1) if distinct else hits)
    return torch.stack(rows) if rows else torch.zeros(0, sc.hidden, dtype=sc.torch_dtype)


def _same_rows(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal as multisets of rows (order is the dispatcher's business)."""
    assert got.shape == want.shape, f"{what}: {tuple(got.shape)} rows, expected {tuple(want.shape)}"
    key = torch.randn(got.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    g = got[torch.argsort(got.double() @ key)]
    w = want[torch.argsort(want.double() @ key)]
    assert torch.equal(g, w), f"{what}: rows differ"


def _check_layout(layout, sc: Scenario, inputs, rank: int, world: int, backend: str) -> dict:
    e_local = sc.num_experts // world
    info = {"padding_rows": 0, "capacity": None}
    if isinstance(layout, ContiguousLayout):
        align = BACKENDS[backend].kwargs["align"]
        offs, counts = layout.expert_offsets, layout.num_tokens_per_expert
        assert offs.dtype == torch.int32 and counts.dtype == torch.int32
        assert offs.shape == (e_local + 1,) and counts.shape == (e_local,)
        assert int(offs[0]) == 0 and layout.x.shape[0] == int(offs[-1]), "offsets do not span x"
        sizes = offs[1:] - offs[:-1]
        assert bool((sizes % align == 0).all()), f"segments {sizes.tolist()} not aligned to {align}"
        assert bool(((sizes >= counts) & (sizes < counts + align)).all()), "segment padding wrong"
        for e in range(e_local):
            want = _expected_rows(sc, inputs, rank * e_local + e, distinct=False)
            lo = int(offs[e])
            _same_rows(layout.x[lo : lo + int(counts[e])], want, f"expert {e}")
        info["padding_rows"] = int((sizes - counts).sum())
    else:
        assert isinstance(layout, MaskedLayout)
        rounds = max(1, math.ceil(max(sc.tokens) / CAP))
        assert layout.x.shape == (e_local, rounds * world * CAP, sc.hidden), tuple(layout.x.shape)
        assert layout.masked_m.dtype == torch.int32 and layout.masked_m.shape == (e_local,)
        for e in range(e_local):
            want = _expected_rows(sc, inputs, rank * e_local + e, distinct=True)
            _same_rows(layout.x[e, : int(layout.masked_m[e])], want, f"expert {e}")
        info["capacity"] = layout.x.shape[1]
    return info


def _step(disp, x, ids, w, batch, sc, rank, identity):
    disp.dispatch_a(x, ids, w, batch)
    layout = disp.dispatch_b()
    disp.combine_a(_run_experts(layout, sc, rank, identity))
    return layout, disp.combine_b()


def _try(results: dict, key: tuple, fn) -> None:
    try:
        out = fn()
        results[key] = ("ok", out)
    except Exception as exc:  # noqa: BLE001 - reported per case to the parent
        results[key] = ("fail", f"{type(exc).__name__}: {exc}")


def _tolerance(sc: Scenario) -> dict:
    return {"atol": 2e-2, "rtol": 2e-2} if sc.dtype == "bfloat16" else {"atol": 1e-5, "rtol": 1e-5}


def run_suite(rank: int, world: int, names: list[str]) -> dict:
    results: dict = {}
    cache: dict = {}
    idle = ForwardBatch.idle()
    for sc in scenarios(world):
        inputs = make_inputs(sc)
        x, ids, w = inputs[rank]
        for backend in names:
            be = BACKENDS[backend]
            if be.only is not None and sc.name not in be.only:
                continue
            mode = be.expect_mode
            key = (backend, sc.num_experts, sc.hidden, sc.topk, sc.dtype)
            if key not in cache:
                cache[key] = _build(backend, sc, rank, world)
            disp = cache[key]
            batch = with_header(idle, sc.tokens, be.any_extend) if be.header else None
            layout, out = _step(disp, x, ids, w, batch, sc, rank, identity=True)
            if mode is not None:
                _try(results, (sc.name, backend, "mode"), lambda d=disp, m=mode: _assert_eq(d.last_mode, m))

            def identity_check(out=out, x=x, ids=ids, w=w, sc=sc):
                want = (x.float() * torch.where(ids >= 0, w, 0.0).sum(1, keepdim=True)).to(x.dtype)
                assert out.dtype == x.dtype and out.shape == x.shape
                torch.testing.assert_close(out, want, **_tolerance(sc))

            _try(results, (sc.name, backend, "identity"), identity_check)
            _try(results, (sc.name, backend, "layout"),
                 lambda layout=layout, sc=sc, inputs=inputs, b=backend: _check_layout(layout, sc, inputs, rank,
                                                                                     world, b))
            _, out = _step(disp, x, ids, w, batch, sc, rank, identity=False)
            _try(results, (sc.name, backend, "experts"),
                 lambda out=out, sc=sc, x=x, ids=ids, w=w: torch.testing.assert_close(
                     out.float(), dense_reference(sc, x, ids, w).to(sc.torch_dtype).float(), **_tolerance(sc)))
    _interleaved(rank, world, results)
    return results


def _assert_eq(a, b) -> None:
    assert a == b, f"{a!r} != {b!r}"


def _interleaved(rank: int, world: int, results: dict) -> None:
    """Two micro-batches with a dispatcher each, halves interleaved as two-batch overlap runs them."""
    for backend in ("allgather", "normal", "low_latency", "symm"):
        sc_a = Scenario("tbo_a", tuple(3 + 5 * r for r in range(world)), 2 * world, 3, "uniform", seed=21)
        sc_b = dataclasses.replace(sc_a, name="tbo_b", tokens=tuple(CAP + 2 - r for r in range(world)), seed=22)
        disps = [_build(backend, sc, rank, world) for sc in (sc_a, sc_b)]
        inputs = [make_inputs(sc)[rank] for sc in (sc_a, sc_b)]
        batches = [with_header(ForwardBatch.idle(), sc.tokens, backend not in ("low_latency", "symm"))
                   for sc in (sc_a, sc_b)]
        for d, (x, ids, w), b in zip(disps, inputs, batches, strict=True):
            d.dispatch_a(x, ids, w, b)
        layouts = [d.dispatch_b() for d in disps]
        for d, layout, sc in zip(disps, layouts, (sc_a, sc_b), strict=True):
            d.combine_a(_run_experts(layout, sc, rank, identity=False))
        outs = [d.combine_b() for d in disps]
        for sc, (x, ids, w), out in zip((sc_a, sc_b), inputs, outs, strict=True):
            _try(results, ("interleaved_" + sc.name, backend, "experts"),
                 lambda out=out, sc=sc, x=x, ids=ids, w=w: torch.testing.assert_close(
                     out, dense_reference(sc, x, ids, w), atol=1e-5, rtol=1e-5))


# ---------------------------------------------------------------------------------------------------------------
# The pytest cases: test_ep_dispatch_{2,4}ranks.py import these and define the `world` fixture


_REPORTS: dict[int, dict] = {}


def _report(world: int) -> dict:
    """All ranks' results for `world`, merged: key -> list of (rank, status, payload). Runs the group once."""
    if world not in _REPORTS:
        per_rank = run_ranks(world, run_suite, list(BACKENDS))
        merged: dict = {}
        for rank, res in enumerate(per_rank):
            for key, (status, payload) in res.items():
                merged.setdefault(key, []).append((rank, status, payload))
        _REPORTS[world] = merged
    return _REPORTS[world]


def _assert_case(world: int, key: tuple) -> list:
    entries = _report(world).get(key)
    assert entries, f"no result for {key}"
    failures = [f"rank {r}: {p}" for r, s, p in entries if s != "ok"]
    assert not failures, "\n".join(failures)
    return [p for _, _, p in entries]


SCENARIO_NAMES = [sc.name for sc in scenarios(2)]  # the same names for every world size
CASES = [(sc, backend, check) for sc in SCENARIO_NAMES for backend, be in BACKENDS.items()
         if be.only is None or sc in be.only for check in ("identity", "experts", "layout")]


@pytest.mark.parametrize(("scenario", "backend", "check"), CASES, ids=["-".join(c) for c in CASES])
def test_dispatch(world: int, scenario: str, backend: str, check: str) -> None:
    _assert_case(world, (scenario, backend, check))


@pytest.mark.parametrize("backend", ["auto_prefill", "auto_decode", "symm_auto_decode"])
def test_auto_resolves_mode(world: int, backend: str) -> None:
    for name in SCENARIO_NAMES:
        _assert_case(world, (name, backend, "mode"))


@pytest.mark.parametrize("backend", ["allgather", "normal", "low_latency", "symm"])
def test_interleaved_micro_batches(world: int, backend: str) -> None:
    for name in ("interleaved_tbo_a", "interleaved_tbo_b"):
        _assert_case(world, (name, backend, "experts"))


@pytest.mark.parametrize("backend", ["allgather_align4", "normal_align4"])
def test_alignment_pads_some_segment(world: int, backend: str) -> None:
    padding = sum(info["padding_rows"] for name in SCENARIO_NAMES
                  for info in _assert_case(world, (name, backend, "layout")))
    assert padding > 0


@pytest.mark.parametrize("backend", ["low_latency", "symm"])
def test_low_latency_runs_rounds_over_cap(world: int, backend: str) -> None:
    infos = _assert_case(world, ("over_cap_one_rank", backend, "layout"))
    assert [i["capacity"] for i in infos] == [4 * world * CAP] * world  # 3 * CAP + 1 tokens: 4 rounds
