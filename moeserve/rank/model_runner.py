"""ModelRunner: owns the device, the weights, the KV pool and sampling for one rank."""

from __future__ import annotations

import logging
import random
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from moeserve.args import ServerArgs
from moeserve.core.forward_batch import ForwardBatch
from moeserve.ep.stats import enable_local_expert_tokens
from moeserve.kernels import cpu_isa
from moeserve.kvcache.kv_pool import KVPool, make_kv_pool
from moeserve.models.decoder import CausalLM, logit_rows
from moeserve.parallel.state import get_parallel_state
from moeserve.rank.expert_load import eplb_staging_bytes, make_rebalancer, make_recorder
from moeserve.rank.prompt_logprobs import score
from moeserve.rank.request import Req
from moeserve.rank.sampler import SampleOutput, SamplingBatch, sample

if TYPE_CHECKING:
    from moeserve.constrained.base import TokenMask
    from moeserve.rank.scheduled_batch import ScheduledBatch
    from moeserve.rank.speculative.drafter import Drafter
    from moeserve.rank.speculative.round import SpeculativeRound

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30
CPU_DEFAULT_MAX_TOKENS = 1 << 17


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    return torch.device(name)


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


@dataclass
class _EPInfo:
    """This rank's share of the MoE layers, for the memory and expert-utilization log lines."""

    rank: int
    world_size: int
    ep_rank: int
    ep_size: int
    num_moe_layers: int
    num_local_experts: int  # per MoE layer (physical expert slots on this rank)
    num_physical_experts: int  # per MoE layer, over all EP ranks
    expert_bytes: int  # routed experts' weights on this rank, all layers
    backend: str | None  # the dispatch backend that runs (None: no MoE layer)
    backend_desc: str
    dispatch_buffer_bytes: int  # fixed buffers of the dispatchers (all2all low-latency); 0 for the others
    graph_safe: bool  # every dispatcher's decode steps can be captured in a CUDA graph
    extend_graph_safe: bool  # and their extend steps (piecewise graphs)

    @classmethod
    def collect(cls, model: CausalLM) -> _EPInfo:
        """Walks the model's MoE layers and their dispatchers (built at load, so their buffers are allocated
        before the KV pool is sized from the free memory)."""
        ps = get_parallel_state()
        moes = model.moe_layers()
        dispatchers = model.dispatchers()
        desc = ""
        if dispatchers:
            desc = dispatchers[0].describe()
            if dispatchers[0].buffer_bytes():
                desc += f" in each of {len(dispatchers)} dispatchers"
        local = moes[0].experts.num_local_experts if moes else 0
        return cls(rank=ps.rank, world_size=ps.world_size, ep_rank=ps.ep_rank, ep_size=ps.ep_size,
                   num_moe_layers=len(moes), num_local_experts=local, num_physical_experts=local * ps.ep_size,
                   expert_bytes=sum(p.nbytes for m in moes for p in m.experts.parameters()),
                   backend=dispatchers[0].name if dispatchers else None, backend_desc=desc,
                   dispatch_buffer_bytes=sum(d.buffer_bytes() for d in dispatchers),
                   graph_safe=all(d.graph_safe for d in dispatchers),
                   extend_graph_safe=all(d.extend_graph_safe for d in dispatchers))


class GraphRunner(Protocol):
    """A faster way to run some steps than the eager model: CUDA graphs or a compiled forward."""

    def can_run(self, batch: ForwardBatch) -> bool: ...

    def run(self, batch: ForwardBatch) -> torch.Tensor: ...  # logits, as the model's forward (tensors on the device)

    def capture_all(self, progress: bool = True) -> None: ...  # capture (or compile) every shape now, at start-up


class ModelRunner:
    """Loads the model on this rank's device, sizes the KV pool from the memory budget, runs steps."""

    def __init__(self, server_args: ServerArgs, local_rank: int = 0):
        from moeserve.models.loader import load_model, weight_format

        self.args = server_args
        if server_args.speculative_algorithm is not None:
            from moeserve.rank.speculative.support import unsupported_with_speculation

            refused = unsupported_with_speculation(server_args)
            if refused:
                raise ValueError(refused)
        self.device = resolve_device(server_args.device)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
            # The host's tensors here are small (a step's lengths and slots): one thread. With the default (a thread
            # per core) each CPU op waits for the pool to wake, 0.4 ms for a 64-element repeat_interleave against
            # 13 us (scripts/gpu/sdpa_backends.py at 3438fba), every step.
            torch.set_num_threads(1)
        else:
            cpu_isa.select(server_args.cpu_isa)  # before the model's kernels build
        self.model, self.config = load_model(server_args, self.device)
        self.mtp = None  # DeepSeek's MTP layer, the draft model of --speculative-algorithm NEXTN (models/mtp.py)
        if server_args.speculative_algorithm is not None:
            from moeserve.models.loader import load_mtp

            self.mtp = load_mtp(server_args, self.model, self.device)
        self.weight_format = weight_format(self.model)
        self.dtype = next(self.model.parameters()).dtype
        self.weight_bytes = sum(p.numel() * p.element_size() for m in (self.model, self.mtp) if m is not None
                                for p in m.parameters())
        # the routed experts held packed for the bf16 CPU kernels (Experts.packed)
        self.experts_packed = any(getattr(e, "packed", False) is True for e in self.model.modules())
        self.ep = _EPInfo.collect(self.model)
        self.context_length = min(server_args.context_length or self.config.context_length,
                                  self.config.context_length)
        self.vocab_size = self.config.vocab_size
        self.eplb_staging_bytes = eplb_staging_bytes(server_args, self.config, self.device)  # before the KV pool
        self.num_pages = self._num_kv_pages()
        self.rng = random.Random(server_args.random_seed)  # seeds of unseeded requests (the same on every rank)
        self.kv_pool = make_kv_pool(self.config, self.num_pages, server_args.page_size, self.dtype, self.device,
                                    get_parallel_state().attn_tp_size)
        self.expert_tokens = (enable_local_expert_tokens(self.ep.num_local_experts, self.device)
                              if self.ep.num_moe_layers else None)
        self.expert_recorder = make_recorder(server_args, self.config, self.model, self.device)
        self._first_moe = self.model.moe_layers()[0] if self.expert_recorder is not None else None
        self.rebalancer = (make_rebalancer(server_args, self.config, self.model, self.expert_recorder, self.device,
                                           self.eplb_staging_bytes)
                           if self.expert_recorder is not None else None)
        self.speculative: SpeculativeRound | None = None  # set by enable_speculation
        self.runners = self._graph_runners()
        if self.mtp is not None:
            from moeserve.rank.speculative.mtp_drafter import MTPDrafter

            mtp_pool = self.mtp.make_kv_pool(self.num_pages, server_args.page_size, self.dtype, self.device,
                                             get_parallel_state().attn_tp_size)
            self.enable_speculation(MTPDrafter(self.mtp, mtp_pool), server_args.speculative_num_steps)
        draft_graphs = [self.speculative.draft_graphs] if self.speculative and self.speculative.draft_graphs else []
        with self.expert_recorder.not_counting() if self.expert_recorder is not None else nullcontext():
            # last: they capture the model as it will run (compiled first)
            for runner in [*reversed(self.runners), *draft_graphs]:
                runner.capture_all(progress=get_parallel_state().rank == 0)
        logger.info("%s", self.memory_line())

    def _graph_runners(self) -> list[GraphRunner]:
        """The runners the flags and the device allow, in the order a step tries them: decode's CUDA graphs,
        extend's piecewise graphs, the compiled decode (which the decode graphs capture where both run)."""
        a = self.args
        self.compiled = self.graph_runner = self.piecewise = None
        if a.enable_torch_compile:
            from moeserve.rank.compiled_decode import CompiledDecode

            self.compiled = CompiledDecode(self.model, min(a.torch_compile_max_bs, a.max_running_requests),
                                           self.kv_pool, self.device)
        if self.device.type == "cuda" and not a.disable_cuda_graph and self.ep.graph_safe:
            from moeserve.rank.cuda_graph_runner import CudaGraphRunner

            uncaptured = [self.compiled] if self.compiled is not None else []
            max_bs = min(a.cuda_graph_max_bs, a.max_running_requests)
            if self.mtp is not None:  # speculative decoding: verify steps only; prefills read every row's hidden
                self.graph_runner = self._verify_graphs(max_bs)  # states (forward_hidden), eagerly
            else:
                self.graph_runner = CudaGraphRunner(lambda fb: self._run_first(uncaptured, fb), self.kv_pool, max_bs,
                                                    self.context_length, self.device, a.cuda_graph_bs,
                                                    a.num_dp_groups)
                self.piecewise = self._piecewise_graphs()
        # the static-shape decode step (rank/static_shape.py): the decode graphs, else the padded step eagerly
        self.static_decode = self.graph_runner
        if self.graph_runner is None and a.enable_static_shape_decode:
            from moeserve.rank.cuda_graph_runner import batch_buckets
            from moeserve.rank.static_shape import StaticShapeDecode

            self.static_decode = StaticShapeDecode(
                lambda fb: self._run_first(self.runners[1:], fb),
                batch_buckets(min(a.cuda_graph_max_bs, a.max_running_requests), a.cuda_graph_bs), a.num_dp_groups)
        # the static-shape extend step (rank/static_extend.py): the piecewise graphs, else the padded step eagerly
        self.static_extend = self.piecewise if a.enable_static_shape_extend else None
        if self.piecewise is None and a.enable_static_shape_extend:
            from moeserve.rank.piecewise_graph_runner import token_buckets
            from moeserve.rank.static_extend import StaticShapeExtend

            self.static_extend = StaticShapeExtend(self.model, token_buckets(self._extend_max_tokens()),
                                                   a.num_dp_groups)
        extend = self.static_extend or self.piecewise
        return [r for r in (self.static_decode, extend, self.compiled) if r is not None]

    def _piecewise_graphs(self):
        """Extend steps in piecewise CUDA graphs (rank/piecewise_graph_runner.py), where the flags and the EP
        backend allow them; they share the decode graphs' memory pool."""
        a = self.args
        if a.disable_piecewise_cuda_graph:
            return None
        if not self.ep.extend_graph_safe:
            logger.info("piecewise CUDA graphs are off with %s: its extend steps read the split counts back to "
                        "the host; extend steps run eagerly", self.ep.backend_desc)
            return None
        from moeserve.rank.piecewise_graph_runner import PiecewiseGraphRunner

        # several DP groups: only steps padded to the count they agreed (--enable-static-shape-extend)
        return PiecewiseGraphRunner(self.model, self.kv_pool, self._extend_max_tokens(), self.device,
                                    self.graph_runner.pool, a.num_dp_groups if a.enable_static_shape_extend else 1)

    def _verify_graphs(self, max_bs: int):
        """Speculative decoding's verify steps in CUDA graphs: B requests' k + 1 rows each as B * (k + 1) decode
        rows (rank/speculative/verify_rows.py), captured at every request bucket times k + 1, returning the logits
        and hidden states of every row. None with several DP groups (their steps run eagerly: an idle group's
        padded verify is not written yet)."""
        from moeserve.rank.cuda_graph_runner import CudaGraphRunner, batch_buckets

        a = self.args
        if a.num_dp_groups > 1:
            logger.info("speculative decoding with %d DP groups: verify and draft steps run eagerly",
                        a.num_dp_groups)
            return None
        rows = a.speculative_num_steps + 1
        sizes = [b * rows for b in batch_buckets(max_bs, a.cuda_graph_bs)]
        return CudaGraphRunner(self._forward_with_hidden, self.kv_pool, sizes[-1], self.context_length,
                               self.device, sizes, with_hidden=True)

    def _extend_max_tokens(self) -> int:
        """The largest extend step padded to a token bucket: no extend step is larger than the prefill budget
        (larger ones, such as an unchunked long prompt, run eagerly)."""
        a = self.args
        return min(a.piecewise_cuda_graph_max_tokens, a.chunk_size or a.max_prefill_tokens, a.max_prefill_tokens)

    def static_ready(self, fb: ForwardBatch | None) -> bool:
        """This rank can run its part of a static-shape decode step (rank/static_shape.py). Not while the expert
        recorder counts: its counts would include the padding rows."""
        return self.static_decode is not None and self.expert_recorder is None and self.static_decode.ready(fb)

    def static_extend_ready(self, fb: ForwardBatch | None) -> bool:
        """This rank can run its part of a static-shape extend step (rank/static_extend.py); not while the expert
        recorder counts (as static_ready)."""
        return self.static_extend is not None and self.expert_recorder is None and self.static_extend.ready(fb)

    def step_counts(self) -> dict[str, int]:
        """Steps run, by kind (LoadOut.step_counts)."""
        out = {"static_decode": self.static_decode.num_steps} if self.static_decode is not None else {}
        if self.static_extend is not None:
            out["static_extend"] = self.static_extend.num_steps
        for (n, tbo), count in sorted(getattr(self.model, "tbo_steps", {}).items()):
            out[f"{'tbo' if tbo else 'no_tbo'} {n}"] = count
        return out

    def memory_line(self) -> str:
        """The start-up memory line of this rank (SGLang's 'Memory pool end' / 'Load weight end' lines in one)."""
        ep, a = self.ep, self.args
        experts = ""
        if ep.num_moe_layers:
            packed = " packed for the CPU kernels" if self.experts_packed else ""
            experts = (f" (routed experts {_fmt_bytes(ep.expert_bytes)}{packed}: {ep.num_local_experts} of "
                       f"{ep.num_physical_experts} experts in each of {ep.num_moe_layers} MoE layers)")
        buffers = ""
        if ep.backend not in ("none", None):
            buffers = f", EP dispatch buffers {_fmt_bytes(ep.dispatch_buffer_bytes)} ({ep.backend_desc})"
        if self.eplb_staging_bytes:
            buffers += f", EPLB staging at most {_fmt_bytes(self.eplb_staging_bytes)}"
        if self.speculative is not None:  # the draft model's own pool, as many slots as the target's
            buffers += f", draft KV pool {_fmt_bytes(self.speculative.drafter.kv_pool.total_bytes)}"
        return (f"Memory: rank {ep.rank}/{ep.world_size} (EP rank {ep.ep_rank}/{ep.ep_size}): weights "
                f"{_fmt_bytes(self.weight_bytes)} {self.weight_format}{experts}, KV pool {_fmt_bytes(self.kv_pool.total_bytes)} "
                f"({self.num_pages * a.page_size} tokens, page size {a.page_size}){buffers}, dtype "
                f"{str(self.dtype).removeprefix('torch.')}, device {self.device}")

    def expert_utilization_line(self, interval_s: float) -> str | None:
        """Pairs this rank's experts computed since the last call (one host sync), as a log line; None when there
        were none (or the model has no MoE layer). The worker calls it from its periodic log."""
        if self.expert_tokens is None:
            return None
        counts = self.expert_tokens.take()
        total = sum(counts)
        if not total:
            return None
        ep = self.ep
        first = ep.ep_rank * ep.num_local_experts
        mean = total / len(counts)
        return (f"Expert utilization: rank {ep.rank} (EP rank {ep.ep_rank}/{ep.ep_size}, experts "
                f"{first}-{first + ep.num_local_experts - 1} of {ep.num_physical_experts}): {total} token-expert "
                f"pairs over {ep.num_moe_layers} MoE layers in {interval_s:.1f} s ({total / interval_s:.1f}/s, "
                f"{total / ep.num_moe_layers / interval_s:.1f}/s per layer), busiest local expert "
                f"{max(counts) / mean:.2f}x the mean, idlest {min(counts) / mean:.2f}x")

    def _num_kv_pages(self) -> int:
        a = self.args
        per_token = self.config.kv_bytes_per_token(self.dtype, get_parallel_state().attn_tp_size)
        if self.mtp is not None:  # its own pool, as many slots as the target's
            per_token += self.mtp.config.kv_bytes_per_token(self.dtype, get_parallel_state().attn_tp_size)
        if a.max_total_tokens is not None:
            tokens = a.max_total_tokens
        elif self.device.type == "cuda":
            import gc

            gc.collect()  # memory of models already dropped in this process, and the allocator's free blocks,
            torch.cuda.empty_cache()  # would otherwise count as used
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = total * a.mem_fraction_static - used - self.eplb_staging_bytes  # a rebalance's staging
            if budget <= 0:
                raise ValueError(
                    f"--mem-fraction-static {a.mem_fraction_static} leaves no room for the KV cache: weights and "
                    f"buffers already use {used / 2**30:.1f} of {total / 2**30:.1f} GiB; raise it")
            tokens = int(budget // per_token)
        else:
            tokens = min(int((a.kv_cache_bytes or CPU_DEFAULT_KV_BYTES) // per_token), CPU_DEFAULT_MAX_TOKENS)
        pages = tokens // a.page_size
        if pages < 1:
            raise ValueError(f"the KV budget holds {tokens} tokens, less than one page of {a.page_size}")
        return pages

    # ------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the model on one batch: logits [rows of batch.logits_indices, V] float32."""
        fb = batch.to(self.device)
        fb.kv_pool = self.kv_pool
        logits = self._run_first(self.runners, fb)
        if self.expert_recorder is not None:
            self.expert_recorder.on_pass_end(self._first_moe.recorded_rows(fb.num_tokens))
        return logits

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits as `forward` gives them, the final-normed hidden states [T, H] of every row) for a draft model to
        read: a verify step's decode rows from the CUDA graphs captured for them, anything else eagerly."""
        fb = batch.to(self.device)
        fb.kv_pool = self.kv_pool
        graphs = self.graph_runner
        if graphs is not None and graphs.with_hidden and graphs.can_run(fb):
            return graphs.run_hidden(fb)
        return self._forward_with_hidden(fb)

    def _forward_with_hidden(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model.head_hidden_states(fb)  # final-normed: what the head and DeepSeek's MTP read
        return self.model.head_logits(logit_rows(hidden, fb)), hidden

    @property
    def num_draft_tokens(self) -> int:
        """Drafts per request of a verify step (k), 0 without speculative decoding: the scheduler's decode_len."""
        return self.speculative.k if self.speculative is not None else 0

    @property
    def draft_kv_pool(self) -> KVPool | None:
        """The draft model's own KV pool (its slots the target's), None without speculative decoding: the PD
        transfers and the hierarchical cache's host tier carry it beside the target's."""
        return self.speculative.drafter.kv_pool if self.speculative is not None else None

    def enable_speculation(self, drafter: Drafter, num_draft_tokens: int) -> None:
        """Decode by speculative rounds (rank/speculative/round.py) with this draft model."""
        from moeserve.rank.speculative.round import SpeculativeRound
        from moeserve.rank.speculative.support import unsupported_with_speculation

        refused = unsupported_with_speculation(self.args)
        if refused:
            raise ValueError(refused)
        draft_graphs = None
        if self.graph_runner is not None and self.graph_runner.with_hidden:
            from moeserve.rank.speculative.draft_graphs import DraftStepGraphs

            # the draft's decode-row steps (its extend over accepted tokens, its one-token steps)
            draft_graphs = DraftStepGraphs(drafter, self.config.hidden_size, self.dtype, self.graph_runner,
                                           num_draft_tokens + 1)
        elif self.device.type == "cuda":
            logger.info("speculative decoding: verify and draft steps run eagerly")
        self.speculative = SpeculativeRound(self, drafter, num_draft_tokens, draft_graphs)

    def _run_first(self, runners: list[GraphRunner], fb: ForwardBatch) -> torch.Tensor:
        """The step on the first of `runners` that takes it, else the eager model."""
        runner = next((r for r in runners if r.can_run(fb)), None)
        return runner.run(fb) if runner is not None else self.model(fb)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, reqs: list[Req], to_host: bool = True,
               token_mask: TokenMask | None = None) -> SampleOutput:
        """Next token of each request (rows of logits in the same order); to_host=False leaves them on the device
        (no logprobs then). token_mask: the grammars' allowed tokens of the constrained rows."""
        sbatch = SamplingBatch.build(
            [r.params for r in reqs], [r.input_ids for r in reqs], [r.output_ids for r in reqs],
            self.vocab_size, self.device, rng=self.rng,
        )
        sbatch.token_mask = token_mask
        top_n = [r.asked.top_logprobs_num if r.asked.return_logprob else 0 for r in reqs]
        return sample(logits, sbatch, top_n, return_logprob=any(r.asked.return_logprob for r in reqs),
                      to_host=to_host)

    @torch.inference_mode()
    def score_prompt(self, logits: torch.Tensor, batch: ScheduledBatch
                     ) -> tuple[list[float], list[list[tuple[int, float]]]]:
        """Log-probabilities of the prompt tokens that logits [batch.num_prompt_rows, V] predict."""
        top_ns = [r.asked.top_logprobs_num for r, n in zip(batch.prompt_reqs, batch.prompt_counts, strict=True)
                  for _ in range(n)]
        return score(logits, batch.prompt_targets, top_ns)
