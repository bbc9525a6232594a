"""Drive a Scheduler + ModelRunner in the test process: the engine's logic without processes or sockets."""

from __future__ import annotations

from moeserve.args import ServerArgs
from moeserve.constrained.registry import make_grammar_backend
from moeserve.rank.io_struct import GenerateReq, TokenOut
from moeserve.rank.model_runner import ModelRunner
from moeserve.rank.sampling_params import SamplingParams
from moeserve.rank.scheduler import Scheduler
from moeserve.rank.steps import StepPipeline


class InProcessEngine:
    def __init__(self, tokenizer=None, **kwargs):
        self.args = ServerArgs.from_kwargs(**kwargs)
        self.runner = ModelRunner(self.args)
        grammar = make_grammar_backend(self.args.grammar_backend, tokenizer, self.runner.vocab_size)
        self.scheduler = Scheduler.for_runner(self.args, self.runner, tokenizer=tokenizer, grammar=grammar)
        self.steps = StepPipeline(self.scheduler, self.runner, overlap=not self.args.disable_overlap_schedule)
        self.max_steps = 100_000

    def close(self) -> None:
        """Let the host and storage tiers' threads finish (a process that exits while the storage writer is
        busy aborts in torch's teardown)."""
        self.scheduler.close()

    def run(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams,
            return_logprob: bool = False, top_logprobs_num: int = 0, logprob_start_len: int = -1) -> list[dict]:
        """Submit all prompts at once, step until every one finished; per prompt: ids, finish, cached, output and
        input logprobs."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        rids = [f"r{id(self)}-{i}-{len(self.scheduler.reqs)}" for i in range(len(prompts))]
        for rid, p, sp in zip(rids, prompts, params, strict=True):
            self.scheduler.add_request(GenerateReq(rid, p, sp, return_logprob, top_logprobs_num,
                                                   logprob_start_len=logprob_start_len))
        results = {rid: {"output_ids": [], "finish_reason": None, "cached_tokens": 0, "logprobs": [], "top_logprobs": [],
                         "input_logprobs": None, "input_top_logprobs": None} for rid in rids}
        for _ in range(self.max_steps):
            outs: list[TokenOut] = self.steps.step() + self.scheduler.drain_pending()
            for o in outs:
                r = results.get(o.rid)
                if r is None:
                    continue
                r["output_ids"].extend(o.new_token_ids)
                r["cached_tokens"] = o.cached_tokens
                r["spec_verify_ct"] = o.spec_verify_ct
                r["cached_tokens_details"] = o.cached_tokens_details
                if o.logprobs:
                    r["logprobs"].extend(o.logprobs)
                if o.top_logprobs:
                    r["top_logprobs"].extend(o.top_logprobs)
                if o.input_logprobs is not None:
                    assert r["input_logprobs"] is None, "input logprobs sent twice"
                    r["input_logprobs"], r["input_top_logprobs"] = o.input_logprobs, o.input_top_logprobs
                if o.finish_reason is not None:
                    r["finish_reason"] = o.finish_reason
            if all(r["finish_reason"] is not None for r in results.values()):
                self.steps.flush()  # a step still in flight holds only finished requests' dropped tokens
                break
        else:
            raise AssertionError("requests did not finish")
        return [results[rid] for rid in rids]
