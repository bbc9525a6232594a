"""The hierarchical KV cache through the real scheduler and model runner (CPU): two-turn conversations whose
histories do not fit the device pool give the same greedy tokens with the host tier on and off, and with it on
the second turns are served from the host tier (cached_tokens_details). Also with chunked prefill, prompt
logprobs, and 64 conversations with aborts while their KV is being loaded back: no wrong token, and every device
and host page comes back."""

from __future__ import annotations

import json
import random

import pytest
import torch

from moeserve.kvcache import HiRadixCache
from moeserve.rank.io_struct import GenerateReq
from moeserve.rank.sampling_params import SamplingParams
from tests.checkpoints import VOCAB, build_checkpoint
from tests.rank.inprocess import InProcessEngine

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    paths: dict[str, str | None] = {"default": None}

    def get(name: str) -> str | None:
        if name not in paths:
            paths[name] = build_checkpoint(name, tmp_path_factory.mktemp(name))
        return paths[name]

    return get


def _first_turns(seed: int, n: int, system: int = 8, lengths: tuple[int, int] = (24, 40)) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(2, VOCAB) for _ in range(system)]  # a system prompt every conversation starts with
    return [shared + [rng.randrange(2, VOCAB) for _ in range(rng.randrange(*lengths))] for _ in range(n)]


def _seconds(firsts: list[list[int]], one: list[dict], seed: int) -> list[list[int]]:
    """Second turns: each first prompt, its answer, and a new question."""
    rng = random.Random(seed)
    return [p + r["output_ids"] + [rng.randrange(2, VOCAB) for _ in range(6)] for p, r in zip(firsts, one, strict=True)]


def _two_turns(eng: InProcessEngine, firsts: list[list[int]], seed: int, **kw) -> tuple[list[dict], list[dict]]:
    one = eng.run(firsts, GREEDY, **kw)
    return one, eng.run(_seconds(firsts, one, seed), GREEDY, **kw)


def _accounted(eng: InProcessEngine) -> None:
    """Every device page is free or in the cache unlocked; every host page free or held by a tree node."""
    s = eng.scheduler
    cache = s.cache
    assert isinstance(cache, HiRadixCache)
    assert cache.protected_size == 0
    assert s.allocator.num_free_pages * s.page_size + cache.evictable_size == s.allocator.num_pages * s.page_size
    held = sum(len(n.host_value) for n in cache._nodes() if n.host_value is not None)
    assert s.host_pool.allocator.num_free_pages * s.page_size + held == s.host_pool.num_pages * s.page_size


def _engine(model_path, name: str, hierarchical: bool, **kw) -> InProcessEngine:
    extra = dict(enable_hierarchical_cache=True, hicache_ratio=kw.pop("hicache_ratio", 4.0),
                 hicache_write_policy=kw.pop("policy", "write_through")) if hierarchical else {}
    kw = dict(max_total_tokens=96, page_size=2, max_running_requests=4) | kw
    return InProcessEngine(model_path=model_path(name), dtype="float32", **extra, **kw)


@pytest.mark.parametrize(("name", "policy"), [("default", "write_through"), ("v3_q_lora", "write_back"),
                                              ("qwen3_moe", "write_through"), ("default", "write_through_selective")])
def test_second_turns_hit_host_and_tokens_match(model_path, name, policy):
    firsts = _first_turns(48, 4)
    off = _two_turns(_engine(model_path, name, False), firsts, 1)
    eng = _engine(model_path, name, True, policy=policy)
    on = _two_turns(eng, firsts, 1)
    for a, b in zip(off[0] + off[1], on[0] + on[1], strict=True):
        assert a["output_ids"] == b["output_ids"]
    # histories of 4 x ~45 tokens against a 96-token device pool (and 384 on host): the second turns find theirs on the host
    details = [r["cached_tokens_details"] for r in on[1]]
    assert all(d["device"] + d["host"] == r["cached_tokens"] for d, r in zip(details, on[1], strict=True))
    if policy == "write_through_selective":  # a history is copied to host once reused: none was, in turn one
        assert sum(r["cached_tokens"] for r in on[1]) >= sum(r["cached_tokens"] for r in off[1])
    else:
        assert sum(d["host"] for d in details) > 0
        assert sum(r["cached_tokens"] for r in on[1]) > sum(r["cached_tokens"] for r in off[1])
    _accounted(eng)


def test_chunked_prefill_and_prompt_logprobs(model_path):
    firsts = _first_turns(7, 5)
    kw = dict(return_logprob=True, logprob_start_len=30)
    off = _two_turns(_engine(model_path, "v3_q_lora", False, chunked_prefill_size=8), firsts, 2, **kw)
    eng = _engine(model_path, "v3_q_lora", True, chunked_prefill_size=8)
    on = _two_turns(eng, firsts, 2, **kw)
    for a, b in zip(off[0] + off[1], on[0] + on[1], strict=True):
        assert a["output_ids"] == b["output_ids"]
        torch.testing.assert_close(torch.tensor(a["input_logprobs"][1:]), torch.tensor(b["input_logprobs"][1:]))
    assert sum(r["cached_tokens_details"]["host"] for r in on[1]) > 0
    _accounted(eng)


def test_64_conversations_with_aborts_during_load_back(model_path, policy: str = "write_back"):
    firsts = _first_turns(64, 64, system=4, lengths=(10, 20))
    # a 256-token device pool, a host pool (8 x) that holds every history: 64 x ~26 tokens
    kw = dict(max_running_requests=16, max_total_tokens=256)
    reference = _two_turns(_engine(model_path, "v3_q_lora", False, **kw), firsts, 3)[1]
    eng = _engine(model_path, "v3_q_lora", True, policy=policy, hicache_ratio=8.0, **kw)
    seconds = _seconds(firsts, eng.run(firsts, GREEDY), 3)
    s = eng.scheduler
    rids = [f"turn2-{i}" for i in range(64)]
    for rid, p in zip(rids, seconds, strict=True):
        s.add_request(GenerateReq(rid, p, GREEDY))
    outs: dict[str, list[int]] = {rid: [] for rid in rids}
    finished: dict[str, str] = {}
    aborted = set(random.Random(5).sample(rids, 20))
    host_hits = 0
    kinds = [0, 0]  # aborts while waiting, after admission (the prefix loaded back, its prefill in flight)
    for step in range(5000):
        for o in eng.steps.step() + s.drain_pending():
            outs[o.rid].extend(o.new_token_ids)
            if o.cached_tokens_details:
                host_hits = max(host_hits, o.cached_tokens_details["host"])
            if o.finish_reason is not None:
                finished[o.rid] = o.finish_reason.type
        # abort requests right after their admission (their prefix just loaded back) or while they wait
        for rid in [r for r in aborted if r in s.reqs]:
            req = s.reqs[rid]
            if req.row is not None or step % 7 == 3:
                kinds[req.row is not None] += 1
                s.abort(rid)
        if len(finished) == 64:
            break
    else:
        raise AssertionError("requests did not finish (deadline: 5000 steps)")
    eng.steps.flush()
    assert host_hits > 0
    for i, rid in enumerate(rids):
        if finished[rid] == "abort":
            assert rid in aborted
            assert outs[rid] == reference[i]["output_ids"][: len(outs[rid])]
        else:
            assert outs[rid] == reference[i]["output_ids"], f"conversation {i}: wrong tokens"
    assert sum(v == "abort" for v in finished.values()) >= 10 and min(kinds) > 0, kinds
    _accounted(eng)


def test_a_restarted_engine_hits_storage(model_path, tmp_path):
    firsts = _first_turns(11, 4)
    off = _two_turns(_engine(model_path, "qwen3_moe", False), firsts, 4)
    kw = dict(hicache_storage_backend="file", hicache_storage_backend_extra_config=json.dumps({"path": str(tmp_path)}))
    first = _engine(model_path, "qwen3_moe", True, **kw)
    one = first.run(firsts, GREEDY)
    first.close()  # as a server that stops: its storage writes are put (a busy writer left pages unwritten)
    restarted = _engine(model_path, "qwen3_moe", True, **kw)  # fresh device and host pools, the same directory
    two = restarted.run(_seconds(firsts, one, 4), GREEDY)
    for a, b in zip(off[0] + off[1], one + two, strict=True):
        assert a["output_ids"] == b["output_ids"]
    details = [r["cached_tokens_details"] for r in two]
    assert all(d["device"] + d["host"] + d["storage"] == r["cached_tokens"] for d, r in zip(details, two, strict=True))
    assert sum(d["storage"] for d in details) >= 48  # the first turns' pages, read back after the restart
    assert sum(r["cached_tokens"] for r in two) > sum(r["cached_tokens"] for r in off[1])
    _accounted(restarted)


def test_speculation_over_host_and_storage_tiers(tmp_path):
    """NEXTN over the hierarchical cache (the embedded model's trained MTP layer, file storage): second turns whose
    histories come back from host and storage give the plain run's greedy tokens, and the draft's KV comes back
    with the target's: the verify rounds match a run whose device pool holds every history (within a few, for
    rounding between batches), where a draft over another request's stale KV accepts fewer."""
    rng = random.Random(12)
    firsts = [[rng.randrange(2, 3000) for _ in range(48)] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    spec = dict(speculative_algorithm="NEXTN", speculative_num_steps=2, page_size=8, max_running_requests=2,
                disable_overlap_schedule=True)

    def two_turns(eng):
        one = eng.run(firsts, params)
        two = eng.run([p + r["output_ids"] + [rng2.randrange(2, 3000) for _ in range(8)]
                       for p, r in zip(firsts, one, strict=True)], params)
        return one, two

    rng2 = random.Random(13)
    plain = two_turns(InProcessEngine(page_size=8, max_total_tokens=2048))
    rng2 = random.Random(13)
    roomy = two_turns(InProcessEngine(max_total_tokens=2048, **spec))  # every history stays on the device
    rng2 = random.Random(13)
    store = json.dumps({"path": str(tmp_path)})
    eng = InProcessEngine(max_total_tokens=256, enable_hierarchical_cache=True, hicache_ratio=8.0,
                          hicache_storage_backend="file", hicache_storage_backend_extra_config=store, **spec)
    tiered = two_turns(eng)
    for want, got in ((plain, roomy), (plain, tiered)):
        assert [r["output_ids"] for r in want[0] + want[1]] == [r["output_ids"] for r in got[0] + got[1]]
    details = [r["cached_tokens_details"] for r in tiered[1]]
    assert sum(d["host"] + d["storage"] for d in details) >= 8 * 48 // 2, details
    rounds = [sum(r["spec_verify_ct"] for r in run[1]) for run in (roomy, tiered)]
    assert abs(rounds[0] - rounds[1]) <= 0.05 * rounds[0], rounds
    _accounted(eng)
    eng.close()
