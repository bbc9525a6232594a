"""ServerArgs: every flag of moeserve, its default, its help and its validation.

The CLI (`moeserve serve|generate|bench`) and the offline `Engine(**kwargs)` are both built from this one
dataclass. Flag names follow SGLang's where the concept is the same, so `--tp-size 8 --enable-dp-attention`
means what it means there.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, get_args

# A flag's choices come from the registry that maps each name to its implementation (tests/test_flag_registries.py).
from moeserve.constrained.registry import GRAMMAR_BACKENDS
from moeserve.ep.all2all import DEEPEP_MODES
from moeserve.ep.registry import BACKENDS as DISPATCH_BACKENDS
from moeserve.ep.registry import REFUSED_BACKENDS
from moeserve.eplb import rebalancer
from moeserve.eplb.location import DISPATCH_ALGORITHMS
from moeserve.eplb.recorder import RECORDER_MODES
from moeserve.help_text import with_default
from moeserve.kernels import cpu_isa
from moeserve.kvcache.hiradix_cache import WRITE_POLICIES as HICACHE_WRITE_POLICIES
from moeserve.kvcache.storage.registry import BACKEND_NAMES as HICACHE_STORAGE_BACKENDS
from moeserve.kvcache.storage.registry import backend_class, parse_config
from moeserve.kvcache.storage_tier import PREFETCH_POLICIES as HICACHE_PREFETCH_POLICIES
from moeserve.layers.moe.experts import RUNNER_BACKENDS
from moeserve.text.parsers.reasoning import REASONING_PARSERS
from moeserve.text.parsers.tool_calls import TOOL_CALL_PARSERS

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
SCHEDULE_POLICIES = ("fcfs", "lpm")
# KV transfer backends: name -> (module, class), imported only when asked for (disagg/transfer/registry.py)
TRANSFER_BACKENDS = {"mooncake": ("moeserve.disagg.transfer.mooncake", "MooncakeBackend"),
                     "zmq": ("moeserve.disagg.transfer.zmq_backend", "ZmqBackend")}
# speculative decoding: NEXTN drafts with DeepSeek's MTP layer (models/mtp.py); SGLang's EAGLE means the same for
# DeepSeek's MTP. Its other algorithms are refused by name.
SPECULATIVE_ALGORITHMS = (None, "NEXTN", "EAGLE")
REFUSED_SPECULATIVE = {
    "EAGLE3": "EAGLE-3 drafts with a separately trained head over several target layers; moeserve drafts with "
              "DeepSeek's MTP layer: use NEXTN",
    "STANDALONE": "a separate small draft model is not supported; use NEXTN (DeepSeek's MTP layer)",
    "NGRAM": "n-gram drafting is not supported; use NEXTN (DeepSeek's MTP layer)",
}
# NOTE: False until the draft/verify loop (moeserve/rank/) is in this build: every --speculative-algorithm is refused
# by ServerArgs.check, after the speculative flags themselves are checked. The loop's change flips it.
SPECULATIVE_LOOP_READY = True
# SGLang's choice for DeepSeek when none of the three is given: (num_steps, eagle_topk, num_draft_tokens)
SPECULATIVE_DEFAULTS = (3, 1, 4)
# SGLang's other spellings of a flag (its short and long forms), so that an SGLang launch command runs unchanged.
FLAG_ALIASES: dict[str, tuple[str, ...]] = {
    "tp_size": ("--tp", "--tensor-parallel-size"),
    "dp_size": ("--dp", "--data-parallel-size"),
    "ep_size": ("--ep", "--expert-parallel-size"),
}

class PDRole(str, enum.Enum):
    """--disaggregation-mode: this server's side of a PD pair, or NULL for a server that does both."""

    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class PDOptions:
    """The PD role and the --disaggregation-* settings (without the prefix), read once: `ServerArgs.disagg`."""

    role: PDRole
    bootstrap_port: int
    transfer_backend: str
    ib_device: str | None
    bootstrap_timeout: float
    waiting_timeout: float
    transfer_timeout: float
    heartbeat_interval: float
    heartbeat_timeout: float
    debug_failure_prob: float

    @property
    def enabled(self) -> bool:
        return self.role is not PDRole.NULL

    @property
    def is_prefill(self) -> bool:
        return self.role is PDRole.PREFILL

    @property
    def is_decode(self) -> bool:
        return self.role is PDRole.DECODE


def _flag(default: Any, help: str, choices: tuple | None = None, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices, **kw})


@dataclass
class ServerArgs:
    """All configuration of a moeserve server or offline engine."""

    # --- model and tokenizer ---
    model_path: str | None = _flag(
        None, "Directory of a Hugging Face checkpoint (config.json + safetensors). Default: the embedded tiny model."
    )
    tokenizer_path: str | None = _flag(None, "Tokenizer directory (default: --model-path).")
    served_model_name: str | None = _flag(
        None, "Model name the API reports and accepts (default: the model directory's name; 'default' for the "
        "embedded model).")
    dtype: str = _flag("auto", "Weight and activation dtype; auto takes the checkpoint's (float32 on CPU).", DTYPES)
    load_format: str = _flag(
        "auto", "auto/safetensors read the checkpoint; dummy makes random weights of the real shapes.", LOAD_FORMATS
    )
    context_length: int | None = _flag(None, "Maximum tokens per request (prompt + output); default from config.")
    quantization: str | None = _flag(
        None, "fp8: quantize an unquantized checkpoint at load to DeepSeek's block FP8 (e4m3, 128x128 weight blocks, "
        "activations per token in groups of 128). FP8 checkpoints (quantization_config in config.json) load as FP8 "
        "without it.", (None, "fp8"))
    grammar_backend: str = _flag(
        "xgrammar", "Structured outputs (json_schema, regex, ebnf; response_format): xgrammar, or none (such requests "
        "get HTTP 400).", tuple(GRAMMAR_BACKENDS))
    reasoning_parser: str | None = _flag(
        None, "Chat: the model's thinking (<think> ... </think>) returned apart as reasoning_content, in responses "
        "and stream deltas (SGLang's names; deepseek-v3 thinks when chat_template_kwargs has thinking: true).",
        (None, *REASONING_PARSERS))
    tool_call_parser: str | None = _flag(
        None, "Chat: tool calls parsed from the model's tool-call markers into OpenAI's tool_calls (SGLang's names: "
        "deepseekv3, deepseekv31); without it a request with tools gets HTTP 400.", (None, *TOOL_CALL_PARSERS))
    skip_tokenizer_init: bool = _flag(False, "Take and return token ids only; no tokenizer is loaded.")
    random_seed: int = _flag(0, "Seed for dummy weights and unseeded sampling.")
    trust_remote_code: bool = _flag(
        False, "Accepted so that SGLang's commands run: moeserve runs no code from a checkpoint (only its own model "
        "classes), with or without it.")

    # --- HTTP ---
    host: str = _flag("127.0.0.1", "HTTP host to bind.")
    port: int = _flag(30000, "HTTP port.")
    api_key: str | None = _flag(None, "If set, requests must carry 'Authorization: Bearer KEY' (but /health and "
                                "/metrics, as SGLang; docs/reliability.md).")
    api_key_all_routes: bool = _flag(False, "With --api-key, /health and /metrics ask for the key too.")
    http_header_timeout: float = _flag(10.0, "Seconds a client has to send a request's headers; then it is closed.")
    http_read_timeout: float = _flag(30.0, "Seconds a client may send no byte in the middle of a body; then it is "
                                     "closed.")
    log_level: str = _flag("info", "Logging level.", ("debug", "info", "warning", "error"))
    log_interval_s: float = _flag(5.0, "Seconds between the scheduler's throughput log lines.")
    decode_log_interval: int = _flag(40, "Log one line every this many decode steps (running requests, decode "
                                     "tok/s since the last such line), besides the periodic lines.")
    watchdog_timeout: float = _flag(
        300.0, "Seconds one step may run: a rank whose step runs longer logs where it is stuck and exits (the server "
        "then names the dead rank and stops), as SGLang's watchdog.")
    stream_interval: int = _flag(1, "Send a streaming chunk every this many tokens.")
    max_concurrent_requests: int = _flag(4096, "HTTP requests in flight above this are refused with 503 (429 with "
                                         "--disaggregation-mode: sglang-router retries it), with Retry-After.")
    shutdown_timeout: float = _flag(
        20.0, "Seconds that SIGTERM or SIGINT leaves the requests in flight to finish (new ones get 503) before the "
        "rest end with a 503 error and the server stops; a second signal stops it at once.")

    # --- device and memory ---
    device: str = _flag("auto", "cpu, cuda, or auto (cuda when available).", ("auto", "cpu", "cuda"))
    mem_fraction_static: float = _flag(
        0.85, "CUDA: fraction of GPU memory for weights + KV cache; the KV pool takes what weights leave."
    )
    max_total_tokens: int | None = _flag(None, "KV pool size in tokens (overrides the memory budget).")
    kv_cache_bytes: int | None = _flag(None, "CPU: KV pool budget in bytes (default 1 GiB).")
    page_size: int = _flag(1, "Tokens per KV page.")
    disable_radix_cache: bool = _flag(False, "Turn off prefix sharing between requests.")

    # --- CPU kernels ---
    cpu_isa: str = _flag(
        "auto", "Instruction set of moeserve's C++ CPU kernels: amx (AMX tiles for the bf16 experts, AVX-512 BF16), "
        "avx512bf16 (AVX-512 BF16 dot products, no AMX: AMD Zen 4 and later), avx512, avx2, or auto (the best this "
        "CPU has, logged at start). An ISA the CPU lacks is refused.",
        cpu_isa.CHOICES)

    # hierarchical KV cache
    enable_hierarchical_cache: bool = _flag(
        False, "Keep prefix-cache pages that leave the device KV pool in a host memory pool (pinned on CUDA), still "
        "indexed by the prefix cache; a later match loads them back before the request's prefill.")
    hicache_ratio: float = _flag(2.0, "Host KV pool size as a multiple of the device KV pool.")
    hicache_size: int = _flag(0, "Host KV pool size in GB; overrides --hicache-ratio when > 0.")
    hicache_write_policy: str = _flag(
        "write_through", "When device pages are copied to host: write_through (when a sequence enters the prefix "
        "cache), write_through_selective (when a later request first reuses them), write_back (when they are "
        "evicted from the device).", HICACHE_WRITE_POLICIES)
    hicache_storage_backend: str | None = _flag(
        None, "A storage tier below host memory, pages keyed by their prefix's content: file (a directory; a "
        "restarted server finds its pages) or mooncake (Mooncake's store, where installed). Every host copy is "
        "written there; a match reads the pages that continue it.", (None, *HICACHE_STORAGE_BACKENDS))
    hicache_storage_prefetch_policy: str = _flag(
        "best_effort", "How long a match reads from storage: the read runs in the scheduler before the request's "
        "prefill, so best_effort and wait_complete take every stored page; timeout stops at 0.5 s + 0.25 s per "
        "1,024 tokens.", HICACHE_PREFETCH_POLICIES)
    hicache_storage_backend_extra_config: str | None = _flag(
        None, "The storage backend's settings as a JSON object, e.g. '{\"path\": \"/data/kv\", \"max_bytes\": "
        "100000000000}' for file (default directory: $MOESERVE_CACHE/kv_storage).")

    # --- scheduling ---
    max_running_requests: int = _flag(256, "Most requests decoding at once.")
    chunked_prefill_size: int = _flag(
        8192, "Most prompt tokens prefilled in one step; longer prompts are split. -1 turns chunking off."
    )
    max_prefill_tokens: int = _flag(16384, "Most new prompt tokens admitted in one prefill step.")
    schedule_policy: str = _flag("fcfs", "Order of the waiting queue: fcfs, or lpm (longest prefix match first).",
                                 SCHEDULE_POLICIES)
    enable_mixed_chunk: bool = _flag(
        False, "Run a prefill (or a chunk of one) in the same step as the running decodes, so a long prompt does not "
        "stall them; the prefill's token budget shrinks by one token per decode.")
    disable_overlap_schedule: bool = _flag(
        False, "Run each step's host work (scheduling the next batch, sending the last one's tokens) after the device "
        "finished the step, instead of while it runs. Overlap is off anyway with several ranks in a group or the "
        "expert-distribution recorder (the log says so).")
    new_token_ratio: float = _flag(
        0.4, "Admission reserves this fraction of each running request's remaining max_new_tokens."
    )

    # --- parallelism ---
    tp_size: int = _flag(1, "Ranks (GPUs or CPU processes) of this server.")
    dp_size: int = _flag(1, "Attention data-parallel groups (with --enable-dp-attention).")
    ep_size: int | None = _flag(
        None, "Expert-parallel size of MoE layers: the tp size (the default), or 1: with --tp-size N and no DP "
        "attention a tensor-parallel MoE (every expert's intermediate dimension split over the N ranks, FP8 on "
        "whole 128-row blocks); with DP attention every rank keeps whole experts for its own group's tokens.")
    enable_dp_attention: bool = _flag(False, "Data-parallel attention: dp_size groups with their own requests.")
    nnodes: int = _flag(1, "Nodes of this server.")
    node_rank: int = _flag(0, "This node's rank.")
    dist_init_addr: str | None = _flag(None, "host:port of node 0 for torch.distributed (multi-node).")
    dist_port: int | None = _flag(None, "Port for torch.distributed on one node (default: a free port).")
    dist_timeout: int | None = _flag(None, "Seconds torch.distributed's rendezvous and collectives wait for the "
                                     "other ranks (default: 1800).")
    moe_dense_tp_size: int | None = _flag(
        None, "Tensor-parallel size of the dense MLPs. moeserve replicates them on every rank, each rank computing "
        "its own DP group's tokens with no all-reduce: 1 (as SGLang's large-EP commands pass) says so; other values "
        "are refused.")
    enable_dp_lm_head: bool = _flag(
        False, "With --enable-dp-attention: the LM head vocabulary-parallel over each attention-TP group (each rank "
        "its share of the vocabulary, the logits gathered in the group), so no DP group waits on another (as SGLang). "
        "Without it every rank holds the whole LM head, which is the same with one rank per DP group.")

    # --- MoE / EP ---
    moe_a2a_backend: str = _flag(
        "none", "Expert dispatch: none (all experts local; with --ep-size > 1 it means allgather, like SGLang's "
        "default all-reduce MoE path), allgather (every rank sees every token: the oracle), all2all (see "
        "--deepep-mode), symm (all2all's modes; low-latency steps write only the routed rows into peer memory: "
        "torch's symmetric memory on CUDA, shared memory for the CPU ranks of one node; elsewhere all2all, with a "
        "warning).", tuple(DISPATCH_BACKENDS)
    )
    deepep_mode: str = _flag("auto", "all2all and symm mode: normal (prefill), low_latency (decode), auto.", DEEPEP_MODES)
    enable_deepep_moe: bool = _flag(False, "SGLang's old spelling of --moe-a2a-backend deepep.")
    deepep_config: str | None = _flag(None, "DeepEP's tuning file (with --moe-a2a-backend deepep only).")
    moe_runner_backend: str = _flag(
        "auto", "Routed experts' kernels: grouped_gemm (torch's grouped GEMM), cpu_kernel (moeserve's CPU kernel, "
        "compiled on first use; few rows per expert), triton (moeserve's Triton kernels, CUDA), auto (cpu_kernel on "
        "the CPU where it builds, triton on CUDA where Triton imports, else grouped_gemm).", RUNNER_BACKENDS
    )
    ep_max_tokens_per_rank: int = _flag(128, "low_latency: static token capacity per rank per dispatch.")
    enable_two_batch_overlap: bool = _flag(False, "Split each step in two micro-batches to overlap comm.")
    tbo_token_threshold: int = _flag(64, "TBO only runs on steps with at least this many tokens.")
    ep_num_redundant_experts: int = _flag(0, "Extra physical expert slots for replicas of hot experts.")
    enable_shared_experts_fusion: bool = _flag(
        False, "Run the shared experts as routed experts that every token picks with weight 1, in the same grouped "
        "GEMMs (one expert per moe_intermediate_size of the shared MLP): four fewer kernels a layer, and the shared "
        "weights read by the grouped GEMM; steps of 512 tokens or more run them apart as a dense MLP on the same "
        "weights. One EP rank, no EPLB; FP8 weights where the shared experts split on the 128 x 128 scale blocks. "
        "Without this flag they are fused where that is known to pay: on CUDA, bf16/fp16/fp32 weights, one rank "
        "(see --disable-shared-experts-fusion).")
    disable_shared_experts_fusion: bool = _flag(
        False, "Keep the shared experts apart (their own dense MLP) even where they would be fused by default.")
    init_expert_location: str = _flag(
        "trivial", "Expert placement: trivial (slot r holds expert r mod E), or a file: a placement saved by "
        "moeserve.eplb (physical_to_logical_map) or a recorder dump (logical_count) to plan one from.")
    ep_dispatch_algorithm: str = _flag(
        "static", "How a token picks among an expert's replicas: static (each rank's table: a replica on its own "
        "GPU, else its node, else spread), dynamic (at random, so a hot expert's replicas share its load) or fake "
        "(every token routed to k experts uniformly at random, replicas as static: the balance perfect EPLB would "
        "reach; the outputs are meaningless).",
        DISPATCH_ALGORITHMS)
    expert_distribution_recorder_mode: str | None = _flag(
        None, "Record expert load (start/stop/dump endpoints): stat (counts per MoE layer and expert), per_pass "
        "(also each forward pass's counts), per_token (also each token's experts).", (None, *RECORDER_MODES))
    expert_distribution_recorder_buffer_size: int = _flag(
        1000, "Bounded recorder buffer: passes kept (per_pass) or tokens kept (per_token).")
    enable_eplb: bool = _flag(
        False, "Rebalance the expert placement while serving, from the recorded load: host copies of every expert, "
        "upload in the background, swap between forward passes (docs/eplb.md).")
    eplb_rebalance_num_iterations: int = _flag(1000, "Forward passes between online rebalances.")
    eplb_rebalance_layers_per_chunk: int | None = _flag(
        None, "MoE layers swapped per forward pass when a rebalance executes (default: all in one pass).")
    eplb_min_rebalancing_utilization_threshold: float = _flag(
        1.0, "No rebalance while the measured balancedness (mean / max routed tokens per GPU, averaged over MoE "
        "layers) is at least this.")
    eplb_min_improvement: float = _flag(
        0.01, "No rebalance when the new placement raises the window's balancedness by less than this.")
    eplb_algorithm: str = _flag(
        "auto", "Placement algorithm: auto (moeserve's, never worse than the reference) or deepseek (DeepSeek's "
        "reference EPLB policy).", tuple(rebalancer.ALGORITHMS))
    eplb_expert_weights: str = _flag(
        "memory", "Where every expert waits on the host for a rebalance: memory (read at start-up; pinned on CUDA) "
        "or mmap (read from the memory-mapped safetensors checkpoint when needed).", rebalancer.WEIGHT_SOURCES)
    eplb_staging_max_mb: float | None = _flag(
        None, "The most device memory (MiB) a rebalance stages at once (incoming experts and their spare buffers); "
        "a larger plan runs in rounds of layer chunks reusing the same buffers. Subtracted before the KV pool is "
        f"sized. Default: {rebalancer.STAGING_FREE_SHARE * 100:.0f} per cent of free device memory on CUDA, "
        f"{rebalancer.STAGING_CPU_DEFAULT >> 20} MiB on the CPU.")
    eplb_debug_fail: str | None = _flag(
        None, "For tests: PHASE:RANK makes that rank fail every rebalance in PHASE (prepare or execute).")

    # --- CUDA graphs, torch.compile ---
    disable_cuda_graph: bool = _flag(False, "Run without CUDA graphs: decode and (piecewise) extend steps eagerly.")
    cuda_graph_max_bs: int = _flag(256, "Largest decode batch captured in a CUDA graph.")
    enable_static_shape_decode: bool = _flag(
        False, "With several DP groups, decode steps where every group runs one agreed padded batch size (an idle "
        "group too), as the CUDA graphs do; always on where decode CUDA graphs run. This flag runs the same padded "
        "steps eagerly where they do not (a CPU, --disable-cuda-graph).")
    enable_static_shape_extend: bool = _flag(
        False, "With several DP groups, prefill (extend) and mixed steps where every group runs one agreed padded "
        "token count (the largest group's, bucketed as the piecewise CUDA graphs; an idle group too): the piecewise "
        "graphs then replay these steps (written, not run on GPUs); where they do not run (a CPU, "
        "--disable-cuda-graph) the same padded steps run eagerly.")
    cuda_graph_bs: list[int] | None = _flag(
        None, "The decode batch sizes captured in CUDA graphs, as SGLang's list (--cuda-graph-bs 1 2 4 8 256); the "
        "largest becomes --cuda-graph-max-bs. Default: buckets up to --cuda-graph-max-bs.", nargs="+")
    disable_piecewise_cuda_graph: bool = _flag(
        False, "Run prefill (extend) and mixed steps eagerly instead of from piecewise CUDA graphs (each layer's "
        "work but attention, captured per token count and padded to it).")
    piecewise_cuda_graph_max_tokens: int = _flag(
        4096, "Largest extend step (in tokens) captured in piecewise CUDA graphs; larger steps run eagerly.")
    enable_torch_compile: bool = _flag(False, "Compile the decode forward with torch.compile (inductor; on the CPU "
                                       "it needs a C++ compiler). Compiled at start-up, one rank only.")
    torch_compile_max_bs: int = _flag(32, "Largest decode batch that runs the compiled forward.")

    # --- PD disaggregation ---
    disaggregation_mode: str = _flag(
        "null", "null (one server does both), prefill or decode: one side of a PD pair behind sglang-router "
        "(docs/disaggregation.md).", tuple(r.value for r in PDRole))
    disaggregation_bootstrap_port: int = _flag(
        8998, "Prefill: port of the bootstrap server where the prefill ranks register and decode asks for them (the "
        "number after the prefill URL in sglang-router's --prefill).")
    disaggregation_transfer_backend: str = _flag(
        "mooncake", "KV transfer backend, the same on both sides: mooncake (Mooncake's Transfer Engine, RDMA or TCP) "
        "or zmq (built in, TCP).", tuple(TRANSFER_BACKENDS))
    disaggregation_ib_device: str | None = _flag(
        None, "mooncake: the RDMA device(s) to use, e.g. mlx5_0 (default: Mooncake's choice, TCP without RDMA).")
    disaggregation_bootstrap_timeout: float = _flag(
        30.0, "Seconds a request waits for its peer to appear: decode for the prefill server to know the room, "
        "prefill for a decode server to ask for it.")
    disaggregation_waiting_timeout: float = _flag(
        60.0, "Seconds a request waits in a healthy peer's queue: decode for KV cache space and for prefill to start "
        "it (then 429: try later); prefill for decode to admit a room decode asked for.")
    disaggregation_transfer_timeout: float = _flag(
        30.0, "Seconds one KV write may take, and decode's wait from the prefill's first write to its report (and "
        "again for a cancellation's acknowledgement).")
    disaggregation_heartbeat_interval: float = _flag(
        1.0, "Seconds between decode's pings to the prefill ranks it waits on.")
    disaggregation_heartbeat_timeout: float = _flag(
        3.0, "A peer silent this many seconds is dead: decode fails its requests (503), prefill drops its "
        "transfers.")
    disaggregation_debug_failure_prob: float = _flag(
        0.0, "For tests: each KV write on the prefill side fails with this probability.")

    # speculative decoding
    speculative_algorithm: str | None = _flag(
        None, "NEXTN (or EAGLE, as SGLang accepts for DeepSeek): draft tokens with the model's multi-token-prediction "
        "layer (DeepSeek-V3/R1's model.layers.61) and verify them in one target step. A model without that "
        "layer is refused at start.", SPECULATIVE_ALGORITHMS)
    speculative_num_steps: int | None = _flag(
        None, "Draft steps per round (chained MTP steps). Default with --speculative-algorithm: 3, as SGLang picks "
        "for DeepSeek.")
    speculative_eagle_topk: int | None = _flag(
        None, "Draft candidates per step: 1 (a chain); larger (tree drafting) is refused. Default: 1.")
    speculative_num_draft_tokens: int | None = _flag(
        None, "Tokens verified per request and round: --speculative-num-steps + 1 with top-k 1 (SGLang's rule). "
        "Default: that.")
    speculative_draft_model_path: str | None = _flag(
        None, "A checkpoint of the target's model whose MTP layer drafts (model.layers.{num_hidden_layers}, as "
        "DeepSeek publishes it). Default: the target's own checkpoint.")

    # ------------------------------------------------------------------
    def __post_init__(self) -> None:
        if self.ep_size is None:
            self.ep_size = self.tp_size
        if self.enable_deepep_moe:  # SGLang's old spelling
            if self.moe_a2a_backend not in ("none", "deepep"):
                raise ValueError(f"--enable-deepep-moe asks for --moe-a2a-backend deepep, but --moe-a2a-backend is "
                                 f"{self.moe_a2a_backend}: pass one of them")
            self.moe_a2a_backend = "deepep"
        if self.cuda_graph_bs:
            self.cuda_graph_bs = sorted(set(self.cuda_graph_bs))
            if self.cuda_graph_bs[0] < 1:
                raise ValueError(f"--cuda-graph-bs sizes must be >= 1, got {self.cuda_graph_bs[0]}")
            self.cuda_graph_max_bs = self.cuda_graph_bs[-1]
        self.check()

    def check(self) -> None:
        """Raise ValueError naming the flag when a value is out of range or inconsistent."""
        if self.speculative_algorithm in REFUSED_SPECULATIVE:
            raise ValueError(f"--speculative-algorithm {self.speculative_algorithm}: "
                             f"{REFUSED_SPECULATIVE[self.speculative_algorithm]}")
        if self.moe_a2a_backend in REFUSED_BACKENDS:
            flag = "--enable-deepep-moe" if self.enable_deepep_moe else f"--moe-a2a-backend {self.moe_a2a_backend}"
            raise ValueError(f"{flag}: {REFUSED_BACKENDS[self.moe_a2a_backend]}")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise ValueError(f"--{_dash(f.name)}={value!r}: choose one of {', '.join(map(str, choices))}")
        cpu_isa.check(self.cpu_isa)
        positive = ["tp_size", "dp_size", "nnodes", "page_size", "max_running_requests", "max_prefill_tokens",
                    "ep_max_tokens_per_rank", "stream_interval", "port", "torch_compile_max_bs",
                    "piecewise_cuda_graph_max_tokens", "decode_log_interval"]
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{_dash(name)} must be >= 1, got {getattr(self, name)}")
        if min(self.http_header_timeout, self.http_read_timeout) <= 0:
            raise ValueError("--http-header-timeout and --http-read-timeout must be > 0 seconds")
        if self.watchdog_timeout <= 0 or (self.dist_timeout is not None and self.dist_timeout <= 0):
            raise ValueError("--watchdog-timeout and --dist-timeout must be > 0 seconds")
        if self.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(f"--mem-fraction-static must be in (0, 1], got {self.mem_fraction_static}")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError("--chunked-prefill-size must be positive, or -1 to disable chunking")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"--max-total-tokens {self.max_total_tokens} is below one page ({self.page_size})")
        if self.enable_dp_attention:
            if self.tp_size % self.dp_size:
                raise ValueError(f"--tp-size {self.tp_size} must be a multiple of --dp-size {self.dp_size}")
        elif self.dp_size != 1:
            raise ValueError("--dp-size > 1 needs --enable-dp-attention")
        if self.moe_dense_tp_size not in (None, 1):
            raise ValueError(f"--moe-dense-tp-size {self.moe_dense_tp_size}: moeserve's dense MLPs run replicated, "
                             "each rank on its own DP group's tokens (--moe-dense-tp-size 1); a tensor-parallel dense "
                             "MLP is not written: leave the flag out or pass 1")
        if self.enable_static_shape_decode and self.tp_size == 1:
            raise ValueError("--enable-static-shape-decode pads the decode steps of several ranks to one size they agree "
                             "on; one rank has nothing to agree: leave the flag out (CUDA graphs pad its steps)")
        if self.enable_static_shape_extend and self.num_dp_groups == 1:
            raise ValueError("--enable-static-shape-extend pads the extend steps of several DP groups to one token "
                             "count they agree on; one DP group has nothing to agree: leave the flag out (piecewise "
                             "CUDA graphs pad its steps)")
        if self.enable_dp_lm_head and not self.enable_dp_attention:
            raise ValueError("--enable-dp-lm-head splits the LM head over each attention-TP group of DP attention: "
                             "it needs --enable-dp-attention")
        if self.deepep_config is not None and self.moe_a2a_backend != "deepep":
            raise ValueError("--deepep-config tunes DeepEP's buffers (--moe-a2a-backend deepep); all2all has no such "
                             "file: its low-latency buffers are sized by --ep-max-tokens-per-rank")
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(f"--ep-size must equal --tp-size ({self.tp_size}) or be 1, got {self.ep_size}")
        if self.tp_moe and (self.enable_eplb or self.ep_num_redundant_experts):
            raise ValueError("--enable-eplb and --ep-num-redundant-experts move experts between EP ranks; a "
                             "tensor-parallel MoE (--ep-size 1, --tp-size > 1) holds every expert on every rank: "
                             "use --ep-size equal to --tp-size")
        if self.tp_size % self.nnodes:
            raise ValueError(f"--tp-size {self.tp_size} must be a multiple of --nnodes {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be in [0, {self.nnodes})")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT of node 0")
        if self.ep_num_redundant_experts < 0:
            raise ValueError("--ep-num-redundant-experts must be >= 0")
        if self.expert_distribution_recorder_buffer_size < 1:
            raise ValueError("--expert-distribution-recorder-buffer-size must be >= 1")
        if self.eplb_rebalance_num_iterations < 1:
            raise ValueError("--eplb-rebalance-num-iterations must be >= 1")
        if self.eplb_rebalance_layers_per_chunk is not None and self.eplb_rebalance_layers_per_chunk < 1:
            raise ValueError("--eplb-rebalance-layers-per-chunk must be >= 1")
        if self.eplb_staging_max_mb is not None and not self.eplb_staging_max_mb > 0:
            raise ValueError(f"--eplb-staging-max-mb must be > 0, got {self.eplb_staging_max_mb}")
        if not 0.0 <= self.eplb_min_rebalancing_utilization_threshold <= 1.0:
            raise ValueError("--eplb-min-rebalancing-utilization-threshold must be in [0, 1]")
        if self.expert_distribution_recorder_mode == "per_token" and self.enable_two_batch_overlap:
            raise ValueError("--expert-distribution-recorder-mode per_token records one micro-batch per pass: it "
                             "does not run with --enable-two-batch-overlap")
        if self.enable_shared_experts_fusion and self.disable_shared_experts_fusion:
            raise ValueError("--enable-shared-experts-fusion and --disable-shared-experts-fusion contradict each other")
        if self.enable_shared_experts_fusion:
            if self.ep_size > 1 or self.enable_dp_attention:
                raise ValueError("--enable-shared-experts-fusion runs with one EP rank (--ep-size 1, no DP attention): "
                                 "the fused shared experts would have to be on every rank")
            if self.moe_a2a_backend != "none":
                raise ValueError("--enable-shared-experts-fusion runs with --moe-a2a-backend none: an EP "
                                 "dispatcher's slots hold the routed top-k only (prefill-size steps run the shared "
                                 "experts apart)")
            if self.enable_eplb or self.ep_num_redundant_experts:
                raise ValueError("--enable-shared-experts-fusion runs without --enable-eplb and "
                                 "--ep-num-redundant-experts: the placement covers the routed experts only")
        self._check_disaggregation()
        self._check_hierarchical_cache()
        if self.enable_mixed_chunk and self.disagg.enabled:
            raise ValueError(f"--enable-mixed-chunk does nothing with --disaggregation-mode {self.disaggregation_mode}: "
                             "a prefill server has no running decodes and a decode server runs no prefill")
        if self.eplb_debug_fail is not None:
            phase, _, rank = self.eplb_debug_fail.partition(":")
            if phase not in ("prepare", "execute") or not rank.isdigit():
                raise ValueError(f"--eplb-debug-fail must be prepare:RANK or execute:RANK, got {self.eplb_debug_fail!r}")
        if self.enable_torch_compile and self.tp_size > 1:
            raise ValueError("--enable-torch-compile runs with one rank for now (--tp-size 1): the expert-parallel "
                             "dispatchers' collectives are not compiled")
        self._check_speculative()

    def _check_speculative(self) -> None:
        """The speculative flags (SGLang's rules for a chain: top-k 1, num_steps + 1 draft tokens), their defaults
        filled in."""
        given = [n for n in ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
                             "speculative_draft_model_path") if getattr(self, n) is not None]
        if self.speculative_algorithm is None:
            if given:
                raise ValueError(f"--{_dash(given[0])} takes effect only with --speculative-algorithm NEXTN")
            return
        if self.speculative_num_steps is None:
            if self.speculative_eagle_topk is not None or self.speculative_num_draft_tokens is not None:
                raise ValueError("--speculative-eagle-topk and --speculative-num-draft-tokens need "
                                 "--speculative-num-steps too (SGLang picks all three, or none)")
            self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens = (
                SPECULATIVE_DEFAULTS)
        if self.speculative_num_steps < 1:
            raise ValueError(f"--speculative-num-steps must be >= 1, got {self.speculative_num_steps}")
        if self.speculative_eagle_topk is None:
            self.speculative_eagle_topk = 1
        if self.speculative_eagle_topk != 1:
            raise ValueError(f"--speculative-eagle-topk {self.speculative_eagle_topk}: tree drafting (several "
                             "candidates a step) is not supported; use 1 (a chain of draft tokens)")
        chain = self.speculative_num_steps + 1
        if self.speculative_num_draft_tokens is None:
            self.speculative_num_draft_tokens = chain
        if self.speculative_num_draft_tokens != chain:
            raise ValueError(f"--speculative-num-draft-tokens {self.speculative_num_draft_tokens}: with "
                             f"--speculative-eagle-topk 1 it is --speculative-num-steps + 1 = {chain} (SGLang "
                             "overrides it with a warning; moeserve runs what was asked or nothing)")
        if not SPECULATIVE_LOOP_READY:
            raise ValueError(f"--speculative-algorithm {self.speculative_algorithm}: the draft/verify loop is not in "
                             "this build yet (the MTP layer loads, moeserve/models/mtp.py, but nothing drafts); run "
                             "without --speculative-algorithm")

    def _check_hierarchical_cache(self) -> None:
        if not self.enable_hierarchical_cache:
            changed = [n for n in HICACHE_DEFAULTS if getattr(self, n) != HICACHE_DEFAULTS[n]]
            if changed:
                raise ValueError(f"--{_dash(changed[0])} takes effect only with --enable-hierarchical-cache")
            return
        if self.disable_radix_cache:
            raise ValueError("--enable-hierarchical-cache keeps the prefix cache's pages in host memory: it needs "
                             "the prefix cache (drop --disable-radix-cache)")
        if self.disagg.is_decode:
            raise ValueError("--enable-hierarchical-cache with --disaggregation-mode decode: a decode server keeps no "
                             "prefix cache (its KV comes from prefill); enable it on the prefill server")
        if self.hicache_ratio <= 0 or self.hicache_size < 0:
            raise ValueError("--hicache-ratio must be > 0 and --hicache-size >= 0 (GB)")
        if self.hicache_storage_backend is None:
            changed = [n for n in HICACHE_STORAGE_DEFAULTS if getattr(self, n) != HICACHE_STORAGE_DEFAULTS[n]]
            if changed:
                raise ValueError(f"--{_dash(changed[0])} takes effect only with --hicache-storage-backend")
            return
        try:  # a backend that cannot load, or settings that are not JSON, say so now rather than in a rank
            backend_class(self.hicache_storage_backend)
            parse_config(self.hicache_storage_backend_extra_config)
        except ValueError as e:
            raise ValueError(f"--hicache-storage-backend {self.hicache_storage_backend}: {e}") from None
        if self.attn_tp_size > 1:
            raise ValueError(f"--hicache-storage-backend with an attention-TP group of {self.attn_tp_size} ranks: "
                             "each rank's scheduler would read its own shard's pages and could find different ones; "
                             "run storage with one rank per attention group (--tp-size 1, or DP attention with "
                             "--dp-size equal to --tp-size)")

    def _check_disaggregation(self) -> None:
        if not self.disagg.enabled:
            changed = [k for k, v in PD_ONLY_DEFAULTS.items() if getattr(self, k) != v]
            if changed:
                raise ValueError(f"--{_dash(changed[0])} takes effect only with --disaggregation-mode prefill or "
                                 "decode")
            return
        for name in ("disaggregation_bootstrap_timeout", "disaggregation_waiting_timeout",
                     "disaggregation_transfer_timeout", "disaggregation_heartbeat_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{_dash(name)} must be > 0 seconds, got {getattr(self, name)}")
        if self.disaggregation_heartbeat_timeout <= self.disaggregation_heartbeat_interval:
            raise ValueError("--disaggregation-heartbeat-timeout must exceed --disaggregation-heartbeat-interval")
        if not 0.0 <= self.disaggregation_debug_failure_prob <= 1.0:
            raise ValueError("--disaggregation-debug-failure-prob must be in [0, 1]")
        if self.disaggregation_ib_device and self.disaggregation_transfer_backend != "mooncake":
            raise ValueError("--disaggregation-ib-device applies to --disaggregation-transfer-backend mooncake only")

    # ------------------------------------------------------------------
    @property
    def num_dp_groups(self) -> int:
        """Attention groups, each with its own requests and KV cache: dp_size with DP attention, else 1."""
        return self.dp_size if self.enable_dp_attention else 1

    @property
    def tp_moe(self) -> bool:
        """A tensor-parallel MoE: each expert's intermediate dimension split over the tp_size ranks (layers/moe)."""
        return self.ep_size == 1 and self.tp_size > 1 and not self.enable_dp_attention

    @property
    def attn_tp_size(self) -> int:
        """Ranks per attention group: tp_size / dp_size with DP attention, tp_size otherwise."""
        return self.tp_size // self.dp_size if self.enable_dp_attention else self.tp_size

    @property
    def disagg(self) -> PDOptions:
        """--disaggregation-mode and its settings, typed. A new object each read (vars() holds the flags only):
        a reader on a hot path keeps what it needs once."""
        return PDOptions(PDRole(self.disaggregation_mode),
                         **{k.removeprefix("disaggregation_"): getattr(self, k) for k in PD_ONLY_DEFAULTS})

    @property
    def chunk_size(self) -> int | None:
        return None if self.chunked_prefill_size == -1 else self.chunked_prefill_size

    # ------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        """Add one --flag per field (and SGLang's aliases of it), with its default and help, in an argument group
        per topic (HELP_GROUPS, in that order); `skip`: fields left out."""
        topic_of = {name: topic for topic, names in HELP_GROUPS.items() for name in names}
        groups = {topic: parser.add_argument_group(topic) for topic in (*HELP_GROUPS, "other")}  # empty: not shown
        for f in dataclasses.fields(ServerArgs):
            if f.name in skip:
                continue
            group = groups[topic_of.get(f.name, "other")]  # tests/test_command_line.py: every flag has its topic
            names = ["--" + _dash(f.name), *FLAG_ALIASES.get(f.name, ())]
            help_text = f.metadata.get("help", "")
            choices = f.metadata.get("choices")
            nargs = f.metadata.get("nargs")
            default = f.default
            if f.type in ("bool", bool):
                group.add_argument(*names, dest=f.name, action="store_true", default=default, help=help_text)
                continue
            kind = _scalar_type(f.type)
            help_text = with_default(help_text, default)
            kwargs: dict[str, Any] = {"default": default, "help": help_text, "dest": f.name}
            if kind is not str or default is not None or nargs:
                kwargs["type"] = kind
            if nargs:
                kwargs["nargs"] = nargs
            if f.name == "moe_a2a_backend":  # refused by name before argparse's "invalid choice"
                kwargs["type"] = _refuse_backend
            if choices:
                kwargs["choices"] = [c for c in choices if c is not None] if None in choices else list(choices)
                if None in choices:
                    kwargs["type"] = str
            if f.name == "speculative_algorithm":  # refused by name before argparse's "invalid choice"
                kwargs["type"] = _refuse_speculative
            group.add_argument(*names, **kwargs)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        """Engine(**kwargs): unknown names are an error that lists the close matches."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            import difflib

            hints = {u: difflib.get_close_matches(u, names, n=1) for u in unknown}
            msg = ", ".join(f"{u}" + (f" (did you mean {h[0]}?)" if h else "") for u, h in hints.items())
            raise TypeError(f"unknown server argument(s): {msg}")
        return cls(**kwargs)


# PD flags that matter only with --disaggregation-mode prefill or decode, and their defaults
PD_ONLY_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServerArgs)
                    if f.name.startswith("disaggregation_") and f.name != "disaggregation_mode"}
# --hicache-* flags that matter only with --enable-hierarchical-cache, and the storage ones only with a backend
HICACHE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServerArgs) if f.name.startswith("hicache_")}
HICACHE_STORAGE_DEFAULTS = {n: d for n, d in HICACHE_DEFAULTS.items() if n.startswith("hicache_storage_")}
# Flags of the HTTP server only: `moeserve generate` (the offline Engine) does not offer them.
SERVE_ONLY_FLAGS = ("host", "port", "api_key", "served_model_name", "max_concurrent_requests", "shutdown_timeout",
                    "node_rank", "nnodes", "dist_init_addr", "disaggregation_mode", "api_key_all_routes",
                    "http_header_timeout", "http_read_timeout", *PD_ONLY_DEFAULTS)


# --help's topics, in the order --help lists them: every ServerArgs field in exactly one (a new flag joins one here;
# tests/test_command_line.py fails on a flag without a topic). Flags that exist to make failures happen in tests
# are under "debugging".
HELP_GROUPS: dict[str, tuple[str, ...]] = {
    "model": ("model_path", "tokenizer_path", "served_model_name", "dtype", "load_format", "context_length",
              "quantization", "grammar_backend", "reasoning_parser", "tool_call_parser", "skip_tokenizer_init",
              "random_seed", "trust_remote_code", "device", "cpu_isa"),
    "parallelism": ("tp_size", "dp_size", "ep_size", "enable_dp_attention", "nnodes", "node_rank", "dist_init_addr",
                    "dist_port", "dist_timeout", "moe_dense_tp_size", "enable_dp_lm_head"),
    "EP and EPLB": ("moe_a2a_backend", "deepep_mode", "enable_deepep_moe", "deepep_config", "moe_runner_backend",
                    "ep_max_tokens_per_rank", "enable_two_batch_overlap", "tbo_token_threshold",
                    "ep_num_redundant_experts", "enable_shared_experts_fusion", "disable_shared_experts_fusion",
                    "init_expert_location", "ep_dispatch_algorithm", "expert_distribution_recorder_mode",
                    "expert_distribution_recorder_buffer_size", "enable_eplb", "eplb_rebalance_num_iterations",
                    "eplb_rebalance_layers_per_chunk", "eplb_min_rebalancing_utilization_threshold",
                    "eplb_min_improvement", "eplb_algorithm", "eplb_expert_weights", "eplb_staging_max_mb"),
    "PD disaggregation": ("disaggregation_mode", "disaggregation_bootstrap_port", "disaggregation_transfer_backend",
                          "disaggregation_ib_device", "disaggregation_bootstrap_timeout",
                          "disaggregation_waiting_timeout", "disaggregation_transfer_timeout",
                          "disaggregation_heartbeat_interval", "disaggregation_heartbeat_timeout"),
    "memory and scheduling": ("mem_fraction_static", "max_running_requests", "chunked_prefill_size",
                              "max_prefill_tokens", "schedule_policy", "enable_mixed_chunk",
                              "disable_overlap_schedule", "new_token_ratio"),
    "CUDA graphs and torch.compile": ("disable_cuda_graph", "cuda_graph_max_bs", "enable_static_shape_decode",
                                      "enable_static_shape_extend", "cuda_graph_bs", "disable_piecewise_cuda_graph",
                                      "piecewise_cuda_graph_max_tokens", "enable_torch_compile",
                                      "torch_compile_max_bs"),
    "speculative decoding": ("speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
                             "speculative_num_draft_tokens", "speculative_draft_model_path"),
    "KV cache": ("max_total_tokens", "kv_cache_bytes", "page_size", "disable_radix_cache"),
    "hierarchical KV cache": ("enable_hierarchical_cache", "hicache_ratio", "hicache_size", "hicache_write_policy",
                              "hicache_storage_backend", "hicache_storage_prefetch_policy",
                              "hicache_storage_backend_extra_config"),
    "server": ("host", "port", "api_key", "api_key_all_routes", "http_header_timeout", "http_read_timeout",
               "max_concurrent_requests", "stream_interval", "shutdown_timeout", "watchdog_timeout", "log_level",
               "log_interval_s", "decode_log_interval"),
    "debugging": ("eplb_debug_fail", "disaggregation_debug_failure_prob"),
}


def _refuse_backend(value: str) -> str:
    if value in REFUSED_BACKENDS:
        raise argparse.ArgumentTypeError(f"{value}: {REFUSED_BACKENDS[value]}")
    return value


def _refuse_speculative(value: str) -> str:
    if value in REFUSED_SPECULATIVE:
        raise argparse.ArgumentTypeError(f"{value}: {REFUSED_SPECULATIVE[value]}")
    return value


def _dash(name: str) -> str:
    return name.replace("_", "-")


def _scalar_type(annotation: Any) -> type:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    if "int" in text:
        return int
    if "float" in text:
        return float
    if args := get_args(annotation):
        return next(a for a in args if a is not type(None))
    return str
