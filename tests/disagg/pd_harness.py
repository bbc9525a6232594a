"""A prefill side and a decode side in the test process: two schedulers and model runners with their PD state
machines, the zmq backend between them and a real bootstrap server, stepped in turn. The PD logic without
processes or HTTP; the colocated reference is tests/rank/inprocess.py's engine on the same flags."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from moeserve.args import ServerArgs
from moeserve.disagg.bootstrap import BootstrapServer
from moeserve.rank.io_struct import GenerateReq, TokenOut
from moeserve.rank.model_runner import ModelRunner
from moeserve.rank.pd_host import make_pd_rooms
from moeserve.rank.sampling_params import SamplingParams
from moeserve.rank.scheduler import Scheduler
from moeserve.rank.steps import StepPipeline
from moeserve.server.launch import free_port


@dataclass
class Side:
    args: ServerArgs
    runner: ModelRunner
    scheduler: Scheduler
    steps: StepPipeline
    outs: dict[str, list[TokenOut]] = field(default_factory=dict)

    def step(self) -> None:
        self.scheduler.pd.poll()
        for o in self.steps.step() + self.scheduler.drain_pending():
            self.outs.setdefault(o.rid, []).append(o)

    def free_pages(self) -> int:
        s = self.scheduler
        assert s.flush_cache(), "requests still in flight"
        return s.allocator.num_free_pages


class PDPair:
    """Prefill + decode of one model; `run` sends prompts to both sides as sglang-router does."""

    def __init__(self, prefill_kwargs: dict | None = None, decode_kwargs: dict | None = None, **common):
        self.port = free_port()
        self.bootstrap = BootstrapServer("127.0.0.1", self.port, common.get("api_key"), 1)
        common = {"disaggregation_transfer_backend": "zmq", "dtype": "float32",
                  "disaggregation_heartbeat_timeout": 30.0, **common}  # one thread steps both: no false deaths
        self.prefill = self._side("prefill", {**common, **(prefill_kwargs or {})})
        self.decode = self._side("decode", {**common, **(decode_kwargs or {})})
        self.rng = random.Random(0)

    def _side(self, mode: str, kwargs: dict) -> Side:
        args = ServerArgs.from_kwargs(disaggregation_mode=mode, disaggregation_bootstrap_port=self.port, **kwargs)
        runner = ModelRunner(args)
        sched = Scheduler(args, runner.num_pages, runner.context_length, runner.config.eos_token_ids,
                          kv_pool=runner.kv_pool, num_draft_tokens=runner.num_draft_tokens,
                          draft_kv_pool=runner.draft_kv_pool)
        sched.pd = make_pd_rooms(args, runner.kv_pool, runner.config, sched, 0, draft_pool=runner.draft_kv_pool)
        return Side(args, runner, sched, StepPipeline(sched, runner, overlap=not args.disable_overlap_schedule))

    def submit(self, rid: str, ids: list[int], params: SamplingParams, return_logprob: bool = False,
               top_logprobs_num: int = 0, to_prefill: bool = True, to_decode: bool = True,
               logprob_start_len: int = -1) -> int:
        room = self.rng.getrandbits(63)
        req = GenerateReq(rid, ids, params, return_logprob, top_logprobs_num, False, bootstrap_host="127.0.0.1",
                          bootstrap_port=self.port, bootstrap_room=room, logprob_start_len=logprob_start_len)
        if to_prefill:
            self.bootstrap.assign_room(room, 0)
            self.prefill.scheduler.add_request(req)
        if to_decode:
            self.decode.scheduler.add_request(req)
        return room

    def finished(self, side: Side, rid: str) -> bool:
        return any(o.finish_reason is not None for o in side.outs.get(rid, []))

    def step_until(self, done, timeout_s: float = 120.0) -> None:
        # by the clock, not a step count: transfers and control messages move on their own threads, and an idle
        # step takes microseconds, so a loaded machine can need many thousands of steps for one transfer
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if done():
                return
            self.prefill.step()
            self.decode.step()
            time.sleep(0.0005)
        raise AssertionError("the PD pair did not get there")

    def result(self, rid: str) -> dict:
        """Decode's answer; the input logprobs are prefill's before decode's, as the router concatenates them
        (each side's None when it sent none; decode's top alternatives are not merged)."""
        outs = self.decode.outs[rid]
        inputs = {}
        for side in ("prefill", "decode"):
            sent = [o for o in getattr(self, side).outs.get(rid, []) if o.input_logprobs is not None]
            assert len(sent) <= 1, f"{side} sent input logprobs twice"
            inputs[side] = sent[0] if sent else None
        merged = None
        if inputs["prefill"] is not None and inputs["decode"] is not None:
            merged = inputs["prefill"].input_logprobs + inputs["decode"].input_logprobs
        return {"output_ids": [t for o in outs for t in o.new_token_ids], "finish_reason": outs[-1].finish_reason,
                "cached_tokens": outs[-1].cached_tokens, "spec_verify_ct": outs[-1].spec_verify_ct,
                "logprobs": [lp for o in outs for lp in (o.logprobs or [])], "input_logprobs": merged,
                "prefill_inputs": inputs["prefill"], "decode_inputs": inputs["decode"]}

    def run(self, prompts: list[list[int]], params: SamplingParams, return_logprob: bool = False,
            top_logprobs_num: int = 0, logprob_start_len: int = -1) -> list[dict]:
        rids = [f"r{self.rng.getrandbits(32)}-{i}" for i in range(len(prompts))]
        for rid, ids in zip(rids, prompts, strict=True):
            self.submit(rid, ids, params, return_logprob, top_logprobs_num, logprob_start_len=logprob_start_len)
        self.step_until(lambda: all(self.finished(self.decode, r) and self.finished(self.prefill, r) for r in rids))
        return [self.result(r) for r in rids]

    def idle(self) -> bool:
        return not (self.prefill.scheduler.pd.busy or self.decode.scheduler.pd.busy
                    or self.prefill.scheduler.has_work() or self.decode.scheduler.has_work()
                    or self.prefill.steps.busy or self.decode.steps.busy)

    def close(self) -> None:
        for side in (self.prefill, self.decode):
            pd = side.scheduler.pd
            pd.close()
            pd.channel.close()
            pd.backend.close()
        self.bootstrap.close()


# (side, state) pairs: the abort comes from that side the first step its request is in that state
ABORTS = [("decode", "bootstrapping"), ("decode", "waiting"), ("decode", "transferring"),
          ("prefill", "bootstrapping"), ("prefill", "prefilling"), ("prefill", "transferring"),
          ("decode", "running")]


def pd_state(pair: PDPair, side: str, rid: str) -> str | None:
    """Request rid's PD state on one side ("running" / "queued" once past PD, None when gone)."""
    s = getattr(pair, side).scheduler
    req = s.reqs.get(rid)
    if req is None:
        return None
    rec = s.pd.by_req.get(id(req))
    if rec is not None:
        return rec.state
    return "running" if req in s.running else "queued"


def abort_in_every_state(pair: PDPair, rids: list[str]) -> dict[str, tuple[str, str]]:
    """Step the pair until every request finished on both sides, aborting one request in each of ABORTS (the
    latest submitted that reaches the state first); -> rid -> the (side, state) it was aborted in."""
    plan: dict[str, tuple[str, str]] = {}

    def step() -> bool:
        for side, state in ABORTS:
            if (side, state) in plan.values():
                continue
            rid = next((r for r in rids[::-1] if r not in plan and pd_state(pair, side, r) == state), None)
            if rid is not None:
                getattr(pair, side).scheduler.abort(rid)
                plan[rid] = (side, state)
        return all(pair.finished(pair.decode, r) and pair.finished(pair.prefill, r) for r in rids)

    pair.step_until(step)
    return plan


def bootstrap_refusal(pair: PDPair, params: SamplingParams) -> str:
    """Submit one request to a pair whose sides cannot pair: it fails at bootstrap (abort, 500) before decode
    reserves any page, and every page stays free; -> the error message."""
    start = pair.decode.scheduler.allocator.num_free_pages
    pair.submit("m", list(range(3, 20)), params)
    pair.step_until(lambda: pair.finished(pair.decode, "m") and pair.finished(pair.prefill, "m"))
    finish = pair.result("m")["finish_reason"]
    assert finish.type == "abort" and finish.status_code == 500
    pair.step_until(pair.idle)
    assert pair.decode.scheduler.allocator.num_free_pages == start
    return finish.message
