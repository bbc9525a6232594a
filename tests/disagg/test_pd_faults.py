"""PD faults in one process (tests/disagg/pd_harness.py), under concurrent traffic: aborts in every state from
either side, and random transfer failures. The survivors' greedy tokens equal the colocated engine's (what KV
corruption by a late write would break), every failed request got a clear error, nothing is left in any state,
and both pools' free pages are back where they started."""

from __future__ import annotations

import random

import pytest

from moeserve.rank.sampling_params import SamplingParams
from tests.disagg.pd_harness import ABORTS, PDPair, abort_in_every_state
from tests.rank.inprocess import InProcessEngine

FLAGS = dict(page_size=4, chunked_prefill_size=8)
PARAMS = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)

@pytest.fixture(scope="module")
def model_path():
    from moeserve.models.default_model import default_model_path

    return default_model_path()


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 400) for _ in range(rng.randrange(6, 40))] for _ in range(n)]


def _settle(pair: PDPair) -> None:
    pair.step_until(pair.idle)


def test_aborts_in_every_state_from_either_side(model_path):
    prompts = _prompts(14, 1)
    ref = InProcessEngine(model_path=model_path, dtype="float32", **FLAGS).run(prompts, PARAMS)
    # a small decode pool: some requests wait for space (the `waiting` state)
    pair = PDPair(model_path=model_path, decode_kwargs=dict(max_total_tokens=160), **FLAGS,
                  max_total_tokens=1024)
    try:
        start = (pair.prefill.free_pages(), pair.decode.free_pages())
        rids = [f"a{i}" for i in range(len(prompts))]
        for rid, ids in zip(rids, prompts, strict=True):
            pair.submit(rid, ids, PARAMS)
        plan = abort_in_every_state(pair, rids)  # the rest run to the end
        _settle(pair)
        assert sorted(plan.values()) == sorted(ABORTS), plan
        assert len(plan) < len(rids) - 4
        for i, rid in enumerate(rids):
            got = pair.result(rid)
            if rid in plan:
                assert got["finish_reason"].type == "abort", (rid, plan[rid], got)
                if plan[rid][0] == "prefill":  # decode's client hears why
                    assert "aborted on the prefill server" in got["finish_reason"].message, got
                    assert got["finish_reason"].status_code == 503
            else:
                assert got["output_ids"] == ref[i]["output_ids"], rid
        # after the faults, a clean round: a late write into freed pages would show here
        again = pair.run(prompts[:6], PARAMS)
        assert [g["output_ids"] for g in again] == [r["output_ids"] for r in ref[:6]]
        _settle(pair)
        assert (pair.prefill.free_pages(), pair.decode.free_pages()) == start
    finally:
        pair.close()


def test_random_transfer_failures(model_path):
    prompts = _prompts(12, 2)
    ref = InProcessEngine(model_path=model_path, dtype="float32", **FLAGS).run(prompts, PARAMS)
    pair = PDPair(model_path=model_path, prefill_kwargs=dict(disaggregation_debug_failure_prob=0.15),
                  max_total_tokens=1024, **FLAGS)
    try:
        start = (pair.prefill.free_pages(), pair.decode.free_pages())
        got = pair.run(prompts, PARAMS)
        failed = [g for g in got if g["finish_reason"].type == "abort"]
        assert 0 < len(failed) < len(got)  # seeded: some fail, some do not
        for g, r in zip(got, ref, strict=True):
            if g["finish_reason"].type == "abort":
                assert g["finish_reason"].status_code == 503
                assert "KV transfer" in g["finish_reason"].message and "injected" in g["finish_reason"].message
            else:
                assert g["output_ids"] == r["output_ids"]
        _settle(pair)
        assert pair.prefill.scheduler.pd.stats.failed == len(failed)
        assert (pair.prefill.free_pages(), pair.decode.free_pages()) == start
    finally:
        pair.close()
