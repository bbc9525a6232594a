"""The step contract with DECODE_LEN tokens per request (a speculative verify step's k + 1), checked without one.

Step results take a token list per request (a fake step of random lists against a plain per-token reference),
the PD `done` message carries lists, the overlap token table holds DECODE_LEN tokens per row, TBO never cuts a
request's decode tokens, and the compiled decode's padding request has DECODE_LEN tokens. DECODE_LEN is patched
where a test needs more than today's 1.
"""

from __future__ import annotations

import random

import pytest
import torch

import moeserve.core.forward_batch as forward_batch
import moeserve.core.tbo_split as tbo_split
import moeserve.rank.compiled_decode as compiled_decode
import moeserve.rank.cuda_graph_runner as cuda_graph_runner
import moeserve.rank.steps as steps
from moeserve.core.forward_batch import ForwardBatch, ForwardMode
from moeserve.rank.io_struct import GenerateReq
from moeserve.rank.pd_host import PDHost
from moeserve.rank.request import FUTURE_TOKEN, Req
from moeserve.rank.sampler import NO_TOKEN
from moeserve.rank.sampling_params import SamplingParams
from moeserve.rank.scheduled_batch import ScheduledBatch, SchedulerStats
from moeserve.rank.step_results import StepResults

EOS = 2
CONTEXT = 40


class Args:
    stream_interval = 1


class FakeScheduler(StepResults, PDHost):
    """The scheduler state StepResults and PDHost read, nothing else."""

    def __init__(self) -> None:
        self.reqs: dict[str, Req] = {}
        self.running: list[Req] = []
        self.pending_out = []
        self.stats = SchedulerStats()
        self.pd = self.pd_role = self.tokenizer = None
        self.args = Args()
        self.context_length = CONTEXT
        self.released: list[tuple[str, bool]] = []

    def _release(self, req: Req, cache: bool) -> None:
        self.released.append((req.rid, cache))

    def add(self, req: Req) -> None:
        self.reqs[req.rid] = req
        self.running.append(req)


def _req(rng: random.Random, i: int, logprobs: bool = True) -> Req:
    params = SamplingParams(max_new_tokens=rng.randint(1, 12), stop_token_ids=[rng.randint(3, 9)])
    prompt = [rng.randint(10, 99) for _ in range(rng.randint(1, 30))]
    return Req.from_generate(GenerateReq(f"r{i}", prompt, params, return_logprob=logprobs, top_logprobs_num=1),
                             eos_token_ids=[EOS])


def _reference(req: Req, steps_tokens: list[list[int]]) -> tuple[list[int], str | None, int]:
    """Tokens kept, finish reason type and the step it ended in: one token at a time, checked after each."""
    out: list[int] = []
    for s, tokens in enumerate(steps_tokens):
        for t in tokens:
            out.append(t)
            if t in req.stop_token_ids:
                return out, "stop", s
            if len(out) >= req.params.max_new_tokens or len(req.input_ids) + len(out) >= CONTEXT:
                return out, "length", s
    return out, None, len(steps_tokens)


def _decode_batch(reqs: list[Req]) -> ScheduledBatch:
    return ScheduledBatch(ForwardMode.DECODE, reqs, [1] * len(reqs), None, [True] * len(reqs))


def _run_step(sched: FakeScheduler, reqs: list[Req], tokens: dict[str, list[int]]) -> list:
    """One decode step of `reqs` (the live ones sample): each sampled request's token list, logprobs -token/10."""
    live = [r for r in reqs if not r.finished]
    for r in live:
        r.add_future()
    ids = [tokens[r.rid] for r in live]
    lps = [[-t / 10 for t in ts] for ts in ids]
    tops = [[[(t, -t / 10)] for t in ts] for ts in ids]
    return sched.process_result(_decode_batch(live), ids, lps, tops)


@pytest.mark.parametrize("seed", range(6))
def test_token_lists_append_stop_and_length_like_one_token_at_a_time(seed):
    rng = random.Random(seed)
    sched = FakeScheduler()
    reqs = [_req(rng, i) for i in range(8)]
    for r in reqs:
        sched.add(r)
    plan = {r.rid: [[rng.choice([EOS, *range(3, 30)]) for _ in range(rng.randint(1, 5))] for _ in range(12)]
            for r in reqs}
    streamed: dict[str, list[int]] = {r.rid: [] for r in reqs}
    for s in range(12):
        for out in _run_step(sched, reqs, {r.rid: plan[r.rid][s] for r in reqs}):
            streamed[out.rid] += out.new_token_ids
    for r in reqs:
        want, why, _ = _reference(r, plan[r.rid])
        assert r.output_ids == want == streamed[r.rid]
        assert (r.finish_reason.type if r.finished else None) == why
        assert r.logprobs == [-t / 10 for t in want] and r.top_logprobs == [[(t, -t / 10)] for t in want]
        assert len(r.output_ids) <= r.params.max_new_tokens
    assert sched.stats.generated == sum(len(r.output_ids) for r in reqs)
    assert sorted(rid for rid, _ in sched.released) == sorted(r.rid for r in reqs if r.finished)


def test_a_stop_inside_the_list_drops_the_rest():
    sched = FakeScheduler()
    req = Req.from_generate(GenerateReq("a", [1, 2, 3], SamplingParams(max_new_tokens=10, stop_token_ids=[7])), [EOS])
    sched.add(req)
    _run_step(sched, [req], {"a": [11, 12]})
    _run_step(sched, [req], {"a": [13, 7, 14, 15]})
    assert req.output_ids == [11, 12, 13, 7] and req.finish_reason.type == "stop"
    assert req.finish_reason.matched == 7 and sched.stats.generated == 4


def test_max_new_tokens_counts_tokens_not_steps():
    sched = FakeScheduler()
    req = Req.from_generate(GenerateReq("a", [1], SamplingParams(max_new_tokens=5, ignore_eos=True)), [EOS])
    sched.add(req)
    _run_step(sched, [req], {"a": [20, 21, 22]})
    assert not req.finished
    _run_step(sched, [req], {"a": [23, 24, 25]})
    assert req.output_ids == [20, 21, 22, 23, 24] and req.finish_reason.type == "length"


def test_a_list_resolves_the_oldest_future_and_keeps_the_later_ones():
    sched = FakeScheduler()
    req = Req.from_generate(GenerateReq("a", [1], SamplingParams(max_new_tokens=20, ignore_eos=True)), [EOS])
    sched.add(req)
    req.add_future()
    req.add_future()  # a second step launched before the first resolved (overlap)
    sched.process_result(_decode_batch([req]), [[30, 31, 32]], None, None)
    assert req.output_ids == [30, 31, 32, FUTURE_TOKEN] and req.num_future == 1
    sched.process_result(_decode_batch([req]), [[33]], None, None)
    assert req.output_ids == [30, 31, 32, 33] and req.num_future == 0


def test_a_non_finite_row_fails_the_request_and_drops_its_tokens():
    sched = FakeScheduler()
    req = Req.from_generate(GenerateReq("a", [1], SamplingParams(max_new_tokens=20)), [EOS])
    sched.add(req)
    _run_step(sched, [req], {"a": [30, 31]})
    outs = _run_step(sched, [req], {"a": [32, NO_TOKEN, 33]})
    assert req.output_ids == [30, 31] and req.finish_reason.status_code == 500
    assert outs[-1].finish_reason is req.finish_reason and sched.released == [("a", False)]


@pytest.mark.parametrize("logprobs", [False, True])
def test_pd_done_carries_token_lists(logprobs):
    rng = random.Random(5)
    prefill, decode = FakeScheduler(), FakeScheduler()
    p_req, d_req = _req(rng, 0, logprobs), _req(rng, 0, logprobs)
    d_req.asked = p_req.asked
    d_req.stop_token_ids = p_req.stop_token_ids
    p_req.params.max_new_tokens = 9
    prefill.add(p_req)
    _run_step(prefill, [p_req], {"r0": [40, 41, 42]})
    done = prefill.pd_first(p_req)
    assert done["tokens"] == [40, 41, 42]
    decode.reqs["r0"] = d_req
    decode.pd_activate(d_req, done)
    assert d_req.output_ids == [40, 41, 42] and decode.stats.generated == 3 and d_req in decode.running
    if logprobs:
        assert d_req.logprobs == [-4.0, -4.1, -4.2] and d_req.top_logprobs == [[(t, -t / 10)] for t in (40, 41, 42)]
    else:
        assert d_req.logprobs == [] and done["logprobs"] is None


def test_pd_done_with_a_stop_inside_finishes_there():
    decode = FakeScheduler()
    req = Req.from_generate(GenerateReq("a", [1, 2], SamplingParams(max_new_tokens=9), return_logprob=True), [EOS])
    decode.reqs["a"] = req
    decode.pd_activate(req, {"tokens": [5, EOS, 6], "logprobs": [-1.0, -2.0, -3.0], "top_logprobs": None})
    assert req.output_ids == [5, EOS] and req.logprobs == [-1.0, -2.0] and req.finish_reason.type == "stop"
    assert decode.pending_out[-1].new_token_ids == [5, EOS] and "a" not in decode.reqs


def _patch_decode_len(monkeypatch, n: int) -> None:
    for module in (forward_batch, tbo_split, steps, compiled_decode, cuda_graph_runner):
        monkeypatch.setattr(module, "DECODE_LEN", n)


def _decode_fb(rng: random.Random, num: int, n: int) -> ForwardBatch:
    seq = [rng.randint(n, 20) for _ in range(num)]
    ids = [rng.randint(0, 99) for _ in range(num * n)]
    slots = list(range(sum(seq)))
    out = [s for b in range(num) for s in slots[sum(seq[:b + 1]) - n:sum(seq[:b + 1])]]
    return ForwardBatch.build(ForwardMode.DECODE, ids, seq, [n] * num, out, slots)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_tbo_never_cuts_a_decode(monkeypatch, n):
    _patch_decode_len(monkeypatch, n)
    rng = random.Random(n)
    for num in range(1, 12):
        fb = _decode_fb(rng, num, n)
        fb.global_num_tokens = [fb.num_tokens, rng.randint(0, 40) * n]
        a, b = tbo_split.split_batch(fb)
        for part in (a, b):
            assert all(e == n for e in part.extend_lens_cpu)  # whole decodes only
        assert a.batch_size == (num + 1) // 2 and a.batch_size + b.batch_size == num
        assert [a.num_tokens, b.num_tokens] == [h[0] for h in tbo_split.micro_headers(fb.global_num_tokens)]
        assert torch.equal(torch.cat([a.input_ids, b.input_ids]), fb.input_ids)


@pytest.mark.parametrize("n", [2, 3])
def test_tbo_mixed_keeps_decodes_whole_when_the_extend_ends_on_a_decode_boundary(monkeypatch, n):
    _patch_decode_len(monkeypatch, n)
    rng = random.Random(7)
    for _ in range(20):
        num_ext, num_dec = rng.randint(1, 3), rng.randint(1, 6)
        ext = [n * rng.randint(1, 4) for _ in range(num_ext)]
        e = ext + [n] * num_dec
        seq = [x + rng.randint(0, 5) for x in e]
        slots = list(range(sum(seq)))
        fb = ForwardBatch.build(ForwardMode.MIXED, [1] * sum(e), seq, e, list(range(sum(e))), slots,
                                num_decodes=num_dec)
        a, b = tbo_split.split_batch(fb)
        assert a.num_decodes + b.num_decodes == num_dec
        for part in (a, b):
            assert part.extend_lens_cpu[len(part.extend_lens_cpu) - part.num_decodes:] == [n] * part.num_decodes


def test_future_inputs_come_from_the_token_table_rows(monkeypatch):
    n = 3
    _patch_decode_len(monkeypatch, n)
    rng = random.Random(3)
    reqs = [_req(rng, i) for i in range(5)]
    for row, r in enumerate(reqs):
        r.row = 2 * row + 1
    table = torch.randint(100, 200, (12, n))
    ext = [4, 2]  # two extend requests, then three decodes whose inputs are in flight
    e = ext + [n] * 3
    known = [rng.randint(0, 99) for _ in range(sum(ext))]
    decode_ids = [FUTURE_TOKEN] * (3 * n)
    decode_ids[4] = 77  # a known decode input stays
    fb = ForwardBatch.build(ForwardMode.MIXED, known + decode_ids, e, e, list(range(sum(e))), list(range(sum(e))),
                            num_decodes=3)
    batch = ScheduledBatch(ForwardMode.MIXED, reqs, e, fb, [True] * 5)
    got = steps._with_known_inputs(fb, batch, table, torch.device("cpu")).input_ids
    want = torch.tensor(known + table[[r.row for r in reqs[2:]]].reshape(-1).tolist())
    want[sum(ext) + 4] = 77
    assert torch.equal(got, want)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_compiled_decode_pads_a_whole_request(monkeypatch, n):
    _patch_decode_len(monkeypatch, n)
    fb = _decode_fb(random.Random(n), 1, n)
    fb.decode_slots = torch.zeros(1, fb.seq_lens_cpu[0], dtype=torch.int64)
    p = compiled_decode._pad_one(fb)
    assert p.batch_size == 2 and p.num_tokens == 2 * n and p.extend_lens_cpu == [n, n]
    assert int(p.qo_indptr[-1]) == p.num_tokens and int(p.kv_indptr[-1]) == p.kv_indices.numel()
    assert p.logits_indices.tolist() == [n - 1, 2 * n - 1] and p.positions.numel() == p.out_cache_loc.numel()


class Letters:
    """A tokenizer of one letter per token id (97 = 'a')."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def test_a_stop_string_inside_the_list_ends_the_output_at_its_token():
    sched = FakeScheduler()
    sched.tokenizer = Letters()
    req = Req.from_generate(GenerateReq("a", [1], SamplingParams(max_new_tokens=20, stop="cd")), [EOS])
    sched.add(req)
    _run_step(sched, [req], {"a": [ord(c) for c in "ab"]})
    _run_step(sched, [req], {"a": [ord(c) for c in "cdef"]})
    assert req.output_ids == [ord(c) for c in "abcd"] and req.finish_reason.matched == "cd"


@pytest.mark.parametrize("n", [1, 3])
def test_graph_buffers_hold_a_decode_batch_like_the_schedulers(monkeypatch, n):
    """The CUDA-graph runner's static batch (its buffers on the CPU here) has the layout ForwardBatch.build gives
    a decode batch of DECODE_LEN tokens per request."""
    _patch_decode_len(monkeypatch, n)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    runner = cuda_graph_runner.CudaGraphRunner(None, None, max_bs=8, max_len=16, device=torch.device("cpu"))
    bs, length = 4, 16
    static = runner._static_batch(bs, length)
    want = ForwardBatch.build(ForwardMode.DECODE, [0] * (bs * n), [length] * bs, [n] * bs, [0] * (bs * n),
                              [0] * (bs * length))
    for f in ("input_ids", "extend_lens", "qo_indptr", "kv_indptr", "logits_indices", "out_cache_loc"):
        assert torch.equal(getattr(static, f), getattr(want, f)), f
    for f in ("seq_lens_cpu", "extend_lens_cpu", "prefix_lens_cpu"):
        assert getattr(static, f) == getattr(want, f), f
    assert static.global_num_tokens == [bs * n] and static.positions.numel() == bs * n
