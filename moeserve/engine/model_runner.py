"""ModelRunner: owns the device, the weights, the KV pool and sampling for one rank."""

from __future__ import annotations

import logging
import random

import torch

from moeserve.args import ServerArgs
from moeserve.engine.forward_batch import ForwardBatch
from moeserve.engine.request import Req
from moeserve.engine.sampler import SampleOutput, SamplingBatch, sample

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30
CPU_DEFAULT_MAX_TOKENS = 1 << 17


def _graph_safe_dispatch(args: ServerArgs) -> bool:
    """Decode can be captured unless its MoE dispatch reads counts on the host (allgather, normal all2all)."""
    from moeserve.ep import resolve_backend

    backend = resolve_backend(args.moe_a2a_backend, args.ep_size)
    return backend == "none" or (backend == "all2all" and args.deepep_mode != "normal")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    return torch.device(name)


class ModelRunner:
    """Loads the model on this rank's device, sizes the KV pool from the memory budget, runs steps."""

    def __init__(self, server_args: ServerArgs, local_rank: int = 0):
        from moeserve.models.loader import load_model

        self.args = server_args
        self.device = resolve_device(server_args.device)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        self.model, self.config = load_model(server_args, self.device)
        self.dtype = next(self.model.parameters()).dtype
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.context_length = min(server_args.context_length or self.config.context_length,
                                  self.config.context_length)
        self.vocab_size = self.config.vocab_size
        self.num_pages = self._num_kv_pages()
        self.rng = random.Random(server_args.random_seed)  # seeds of unseeded requests (the same on every rank)
        self.kv_pool = self.config.make_kv_pool(self.num_pages, server_args.page_size, self.dtype, self.device)
        self.graph_runner = None
        if self.device.type == "cuda" and not server_args.disable_cuda_graph and _graph_safe_dispatch(server_args):
            from moeserve.engine.cuda_graph_runner import CudaGraphRunner

            self.graph_runner = CudaGraphRunner(
                self.model, self.kv_pool, min(server_args.cuda_graph_max_bs, server_args.max_running_requests),
                self.context_length, self.device)
        logger.info(
            "Memory: weights %.2f GiB, KV pool %.2f GiB (%d tokens, page size %d), dtype %s, device %s",
            self.weight_bytes / 2**30, self.kv_pool.total_bytes / 2**30, self.num_pages * server_args.page_size,
            server_args.page_size, str(self.dtype).removeprefix("torch."), self.device,
        )

    def _num_kv_pages(self) -> int:
        a = self.args
        per_token = self.config.kv_bytes_per_token(self.dtype)
        if a.max_total_tokens is not None:
            tokens = a.max_total_tokens
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = total * a.mem_fraction_static - used
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
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            return self.graph_runner.run(fb)
        return self.model(fb)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, reqs: list[Req]) -> SampleOutput:
        """Next token of each request (rows of logits in the same order)."""
        sbatch = SamplingBatch.build(
            [r.params for r in reqs], [r.input_ids for r in reqs], [r.output_ids for r in reqs],
            self.vocab_size, self.device, rng=self.rng,
        )
        top_n = [r.top_logprobs_num if r.return_logprob else 0 for r in reqs]
        return sample(logits, sbatch, top_n, return_logprob=any(r.return_logprob for r in reqs))
