"""--enable-mixed-chunk: a prefill (or a chunk of one) runs in the same step as the running decodes.

Every request's tokens with the flag equal those without it, and transformers' greedy continuation: on the four
architectures' tiny checkpoints, with chunked prefill, with prompts that arrive while others decode (staggered
waves), with prefix-cache hits, with a KV pool small enough to retract, with output and prompt logprobs, with
per-request sampling (seeded temperature, top-k/p, min-p) and penalties, and under two-batch overlap (micro-batches
holding a tail of the decodes). Each run checks that MIXED steps happened (or, without the flag, did not) and that
the scheduler's counters count a mixed step's prefill and decode tokens apart.
"""

from __future__ import annotations

import random

import pytest

import moeserve.models.tbo as tbo_mod
from moeserve.args import ServerArgs
from moeserve.core.forward_batch import ForwardMode
from moeserve.rank.io_struct import GenerateReq
from moeserve.rank.sampling_params import SamplingParams
from moeserve.rank.steps import run_step
from tests.checkpoints import VOCAB
from tests.rank.inprocess import InProcessEngine
from tests.rank.test_generation import assert_matches_hf

NEW = 16
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
LOGPROB_ATOL = 1e-4  # float32: a decode row's logits through another batch composition of the dense layers


def _waves(seed: int, *lengths: list[int], prefix: list[int] | None = None) -> list[list[list[int]]]:
    rng = random.Random(seed)
    return [[(prefix or []) + [rng.randrange(2, VOCAB) for _ in range(n)] for n in wave] for wave in lengths]


def drive(eng: InProcessEngine, waves: list[list[list[int]]], params: list[SamplingParams] | SamplingParams,
          gap: int = 3, **logprob_kwargs) -> tuple[list[dict], list[ForwardMode]]:
    """Submit wave i at step i * gap (later waves arrive while earlier ones decode), step until all finished.
    Returns per prompt (in submission order) its output ids, logprobs and cached tokens, and every step's mode."""
    sched = eng.scheduler
    modes: list[ForwardMode] = []
    schedule = sched.schedule

    def spy():
        batch = schedule()
        if batch is not None:
            modes.append(batch.mode)
            fb = batch.forward
            # what the lock-step header sends: a mixed step is an extend, and its tokens are prefill + decodes
            assert fb.any_extend == batch.mode.is_extend
            assert fb.num_tokens == batch.num_prefill_tokens + batch.num_decodes
            if batch.mode.is_mixed:
                assert 0 < fb.num_decodes < len(batch.reqs) and fb.decode_slots.shape[0] == fb.num_decodes
        return batch

    sched.schedule = spy
    prompts = [p for w in waves for p in w]
    params = params if isinstance(params, list) else [params] * len(prompts)
    rids = [f"r{i}" for i in range(len(prompts))]  # a fresh engine per drive
    res = {rid: {"output_ids": [], "logprobs": [], "top_logprobs": [], "input_logprobs": None, "cached": 0,
                 "done": False} for rid in rids}
    queue = list(zip(rids, prompts, params, strict=True))
    sizes = [len(w) for w in waves]
    step = 0
    try:
        while queue or not all(r["done"] for r in res.values()):
            if queue and sizes and step == gap * (len(waves) - len(sizes)):
                for rid, p, sp in queue[:sizes[0]]:
                    sched.add_request(GenerateReq(rid, p, sp, **logprob_kwargs))
                queue, sizes = queue[sizes[0]:], sizes[1:]
            for o in run_step(sched, eng.runner) + sched.drain_pending():
                r = res[o.rid]
                r["output_ids"] += o.new_token_ids
                r["logprobs"] += o.logprobs or []
                r["top_logprobs"] += o.top_logprobs or []
                r["cached"] = o.cached_tokens
                if o.input_logprobs is not None:
                    r["input_logprobs"] = o.input_logprobs
                r["done"] |= o.finish_reason is not None
            step += 1
            assert step < 10_000, "requests did not finish"
    finally:
        sched.schedule = schedule
    return [res[rid] for rid in rids], modes


def both(path: str, waves, params=GREEDY, gap: int = 3, logprob_kwargs: dict | None = None, **kwargs):
    """drive() without and with --enable-mixed-chunk on fresh engines; checks which modes ran and the counters.
    Returns the two runs' results and their schedulers' counters (keyed by the flag)."""
    out, stats = {}, {}
    for mixed in (False, True):
        eng = InProcessEngine(model_path=path, dtype="float32", enable_mixed_chunk=mixed, **kwargs)
        res, modes = drive(eng, waves, params, gap, **(logprob_kwargs or {}))
        st = eng.scheduler.stats
        assert (ForwardMode.MIXED in modes) == mixed, modes
        assert st.mixed_steps == modes.count(ForwardMode.MIXED)
        assert st.generated == sum(len(r["output_ids"]) for r in res)  # decode rows of mixed steps are counted here
        if st.retractions == 0:  # ... and not as prefill: prefill is exactly the prompts less their cached tokens
            prompts = [p for w in waves for p in w]
            assert st.prefilled == sum(len(p) - r["cached"] for p, r in zip(prompts, res, strict=True))
        assert eng.scheduler.num_used_tokens == 0
        out[mixed], stats[mixed] = res, st
    return out[False], out[True], stats


def _ids(res: list[dict]) -> list[list[int]]:
    return [r["output_ids"] for r in res]


@pytest.mark.parametrize("name", ["v3_q_lora", "v2_lite", "qwen3_moe", "mixtral_swa"])
def test_mixed_equals_plain_and_transformers(tiny_checkpoint, name):
    waves = _waves(1, [5, 40, 9], [50, 3], [23])
    plain, mixed, _ = both(tiny_checkpoint(name), waves, chunked_prefill_size=16)
    assert _ids(mixed) == _ids(plain)
    assert_matches_hf(name, [p for w in waves for p in w], _ids(mixed))


def test_default_model_prefix_hits_and_pages():
    """The embedded default model, pages of 4 tokens: a one-token request caches a 24-token prefix, and the later
    waves' prompts, which start with it, prefill from the cache while the first wave's other request decodes."""
    shared = _waves(5, [24])[0][0]
    later = _waves(6, [3, 12], [7, 30], prefix=shared)
    waves = [[shared, _waves(7, [6])[0][0]], *later]
    params = [SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)] + [GREEDY] * 5
    plain, mixed, _ = both(None, waves, params, gap=2, page_size=4, chunked_prefill_size=20)
    assert _ids(mixed) == _ids(plain)
    assert all(r["cached"] >= 24 for r in mixed[2:]), [r["cached"] for r in mixed]


def test_chunking_off_and_retraction(tiny_checkpoint):
    """No chunked prefill (a whole prompt joins the decodes), and a pool small enough that decodes retract."""
    waves = _waves(3, [30, 25], [31, 28], [20, 26])
    path = tiny_checkpoint("v3_q_lora")
    plain, mixed, stats = both(path, waves, gap=2, chunked_prefill_size=-1, max_total_tokens=160, page_size=2,
                               new_token_ratio=0.0)
    assert stats[True].retractions > 0 and stats[True].mixed_steps > 0
    assert _ids(mixed) == _ids(plain)
    assert_matches_hf("v3_q_lora", [p for w in waves for p in w], _ids(mixed))


def test_logprobs_unchanged(tiny_checkpoint):
    """Output logprobs and top logprobs of decode rows, and prompt logprobs scored chunk by chunk inside mixed
    steps, as without the flag."""
    waves = _waves(4, [6, 33], [40, 2])
    plain, mixed, _ = both(tiny_checkpoint("qwen3_moe"), waves, chunked_prefill_size=12,
                        logprob_kwargs=dict(return_logprob=True, top_logprobs_num=3, logprob_start_len=1))
    assert _ids(mixed) == _ids(plain)
    for p, m in zip(plain, mixed, strict=True):
        assert len(m["logprobs"]) == len(m["output_ids"]) == len(m["top_logprobs"])
        assert max(abs(a - b) for a, b in zip(p["logprobs"], m["logprobs"], strict=True)) <= LOGPROB_ATOL
        for tp, tm in zip(p["top_logprobs"], m["top_logprobs"], strict=True):
            assert [t for t, _ in tm] == [t for t, _ in tp]
            assert max(abs(a - b) for (_, a), (_, b) in zip(tp, tm, strict=True)) <= LOGPROB_ATOL
        assert len(m["input_logprobs"]) == len(p["input_logprobs"]) > 0
        assert max(abs(a - b) for a, b in zip(p["input_logprobs"], m["input_logprobs"], strict=True)) <= LOGPROB_ATOL


def test_sampling_and_penalties_per_request(tiny_checkpoint):
    """Seeded sampling and penalties per request: the same draws whichever steps a request ran in."""
    waves = _waves(8, [7, 35, 4], [28, 11])
    params = [
        SamplingParams(max_new_tokens=NEW, temperature=0.9, top_k=20, seed=11, ignore_eos=True),
        SamplingParams(max_new_tokens=NEW, temperature=0.0, frequency_penalty=0.7, presence_penalty=0.3,
                       ignore_eos=True),
        SamplingParams(max_new_tokens=NEW, temperature=1.1, top_p=0.8, min_p=0.05, seed=3, ignore_eos=True),
        SamplingParams(max_new_tokens=NEW, temperature=0.7, repetition_penalty=1.3, seed=5, ignore_eos=True),
        GREEDY,
    ]
    plain, mixed, _ = both(tiny_checkpoint("mixtral"), waves, params, chunked_prefill_size=16)
    assert _ids(mixed) == _ids(plain)
    assert len({tuple(r["output_ids"]) for r in mixed}) == len(mixed)


def test_two_batch_overlap_splits_mixed_steps(tiny_checkpoint, monkeypatch):
    """TBO on every step: a mixed step's micro-batches hold a tail of the decodes (or none) and match."""
    calls = []
    real = tbo_mod.split_batch

    def counting(batch):
        a, b = real(batch)
        calls.append((batch.mode, batch.num_decodes, a.num_decodes, b.num_decodes))
        return a, b

    monkeypatch.setattr(tbo_mod, "split_batch", counting)
    waves = _waves(9, [5, 40, 9], [50, 3])
    path = tiny_checkpoint("v3_groups")
    plain, mixed, _ = both(path, waves, chunked_prefill_size=24)
    tbo_plain, tbo_mixed, _ = both(path, waves, chunked_prefill_size=24, enable_two_batch_overlap=True,
                                tbo_token_threshold=1)
    assert _ids(tbo_mixed) == _ids(mixed) == _ids(plain) == _ids(tbo_plain)
    split = [(n, a, b) for m, n, a, b in calls if m.is_mixed]
    assert split and all(a + b == n for n, a, b in split)
    assert any(a == 0 < b for _, a, b in split)  # A all prefill, B the rest of it and the decodes


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_refused_with_pd_disaggregation(mode):
    with pytest.raises(ValueError, match="--enable-mixed-chunk does nothing with --disaggregation-mode"):
        ServerArgs.from_kwargs(enable_mixed_chunk=True, disaggregation_mode=mode)
