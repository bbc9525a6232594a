"""Capacity planning: a step-time model of one decode or prefill step of a DP-attention + EP deployment.

Per GPU and per step (all GPUs run in lock-step, each with its own sequences):
- GEMMs (attention projections, dense MLP, shared and routed experts, LM head): a roofline of FLOPs at the
  tensor peak (FP8 for FP8 checkpoints) times `gemm` efficiency, against weight + activation bytes at HBM
  bandwidth times `mem` efficiency, combined as (c^p + m^p)^(1/p): p = inf is the plain max; p = 2 is
  closer to DeepGEMM's published tables near the ridge (the max overshoots its grouped GEMMs by up to 62%).
- Core attention: MLA absorbed for decode (FLOPs per (query, key) pair, KV bytes read once per sequence),
  naive multi-head for prefill (causal: a new token sees its cached prefix and half the new tokens), BF16
  peak times `attn` efficiency.
- Routed experts: the busiest GPU receives 1/balancedness times the mean (T * topk pairs per GPU), so
  imbalance stretches both their GEMMs and the dispatch/combine that feed them.
- Dispatch (FP8, h + h/32 + 16 bytes per row) and combine (BF16, 2h per row): low-latency mode sends one
  row per (token, expert) pair; normal mode one row per (token, destination node) over RDMA, then NVLink
  inside the node. Rows to other nodes go at `rdma` x NIC line rate, rows inside the node at `nvlink` x
  NVLink rate, the slower of the two sets the time, plus a fixed latency per call. Routing is taken as
  uniform over experts (group-limited routing, which would cut inter-node rows further, is ignored).
- Elementwise kernels (norms, residual adds, RoPE, FP8 quantization, permuting rows to and from expert
  order, SiLU): bytes per token and per routed pair at HBM bandwidth.
- Two-batch overlap: each MoE layer runs two half micro-batches A and B through four slots, each as long
  as the longer of its compute and its communication: [attn B | dispatch A] [experts A | dispatch B]
  [experts B | combine A] [attn A of the next layer | combine B] (attn includes the shared expert). In
  prefill DeepEP's normal kernels hold `prefill_comm_sms` SMs meanwhile, slowing compute by
  sms / (sms - comm_sms), and both streams run `prefill_tbo_interference` times slower than alone (the
  SGLang blog finds prefill kernels and communication slower under overlap than in unit tests; decode's
  0-SM communication does not contend). Without TBO a layer takes compute + communication. Dense layers
  never overlap.
- Overheads: a fixed time per layer and micro-batch (launch gaps, CPU waits, small kernels) and per step
  (scheduling, sampling, the lock-step header).
The efficiency constants are calibrated in plan_calibration.py against published SGLang and DeepSeek runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moeserve.eplb.tools.plan_balancedness import estimate_balancedness
from moeserve.eplb.tools.plan_deployment import Deployment
from moeserve.eplb.tools.plan_hardware import GpuSpec
from moeserve.eplb.tools.plan_models import ModelSpec


@dataclass(frozen=True)
class Efficiency:
    """Efficiency constants (fractions of peak) and fixed overheads.

    `gemm`, `rdma`, `prefill_tbo_interference` and `decode_layer_overhead_us` are fitted
    (plan_calibration.fit_efficiency, `moeserve eplb plan --calibration --fit`); the rest are set from
    microbenchmarks or published kernel figures, as their comments say.
    """

    gemm: float = 0.75  # fitted; DeepGEMM reaches 1200-1550 of 1979 FP8 TFLOP/s on large shapes (0.6-0.78)
    attn: float = 0.55  # fraction of BF16 peak for core attention (FlashMLA: 580 of 989 on H800)
    mem: float = 0.80  # fraction of HBM bandwidth when streaming weights and KV (FlashMLA 3000 of 3350 GB/s)
    rdma: float = 0.68  # fitted; DeepEP unit tests reach 0.73-0.87 of the NIC on rows to other nodes
    nvlink: float = 0.80  # fraction of NVLink rate (DeepEP intranode: 153-158 GB/s on H800)
    roofline_p: float = 2.0  # p of the p-norm roofline (fits DeepGEMM's tables); math.inf is the plain max
    comm_latency_us: float = 15.0  # fixed latency of one dispatch or combine call
    prefill_comm_sms: int = 24  # SMs DeepEP's normal kernels take while overlapping (DeepSeek's prefill)
    prefill_tbo_interference: float = 1.15  # fitted; slowdown of compute and comm overlapping in prefill
    decode_layer_overhead_us: float = 0.0  # fitted; per layer and micro-batch, decode (CUDA graphs)
    prefill_layer_overhead_us: float = 100.0  # per layer and micro-batch, prefill (eager; waits on dispatch)
    decode_step_overhead_ms: float = 2.0  # per step: scheduler, sampling, lock-step header
    prefill_step_overhead_ms: float = 20.0


DEFAULT_EFFICIENCY = Efficiency()


@dataclass
class PlanResult:
    """One step of one GPU: time, throughput, a breakdown in ms per step, memory, and the inputs used."""

    phase: str
    step_ms: float
    tokens_per_step: float  # per GPU: output tokens (decode) or input tokens incl. cache hits (prefill)
    tokens_per_s_gpu: float
    tokens_per_s_node: float
    tokens_per_s_total: float
    balancedness: float
    balancedness_source: str
    breakdown_ms: dict[str, float] = field(default_factory=dict)
    memory_gb: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------------------------------------


def roofline_s(flops: float, nbytes: float, peak_tflops: float, compute_eff: float, gpu: GpuSpec,
               eff: Efficiency) -> float:
    """Seconds for a kernel of `flops` and `nbytes`: p-norm of compute time and memory time."""
    compute = flops / (peak_tflops * 1e12 * compute_eff)
    memory = nbytes / (gpu.hbm_tbps * 1e12 * eff.mem)
    if math.isinf(eff.roofline_p):
        return max(compute, memory)
    p = eff.roofline_p
    return (compute**p + memory**p) ** (1.0 / p)


def expected_distinct(bins: int, picks: int) -> float:
    """Expected number of distinct bins hit by `picks` uniform picks among `bins`."""
    return bins * (1.0 - (1.0 - 1.0 / bins) ** picks) if bins > 0 else 0.0


def comm_s(tokens: float, row_bytes: float, model: ModelSpec, gpu: GpuSpec, dep: Deployment, eff: Efficiency,
           balancedness: float) -> float:
    """Seconds for one dispatch or combine of `tokens` tokens per GPU, rows of `row_bytes` bytes."""
    if dep.ep == 1 or tokens <= 0:
        return 0.0
    k, nodes = model.topk, dep.ep_nodes
    gpus_in_node = min(dep.ep, dep.gpus_per_node)
    if dep.dispatch_mode == "low_latency":  # one row per (token, expert) pair
        remote_rows = tokens * k * (nodes - 1) / nodes
        local_rows = tokens * k * (gpus_in_node - 1) / (gpus_in_node * nodes)
    else:  # one row per (token, node) over RDMA, fanned out over NVLink inside the node
        remote_rows = tokens * expected_distinct(nodes, k) * (nodes - 1) / nodes
        local_rows = tokens * expected_distinct(gpus_in_node, k / nodes) * (gpus_in_node - 1) / gpus_in_node
    rdma = remote_rows * row_bytes / (gpu.rdma_gbps * 1e9 * eff.rdma)
    nvlink = local_rows * row_bytes / (gpu.nvlink_gbps * 1e9 * eff.nvlink)
    return max(rdma, nvlink) / balancedness + eff.comm_latency_us * 1e-6


@dataclass
class LayerWork:
    """Seconds of each part of one layer for one micro-batch."""

    attn_proj: float = 0.0
    attn_core: float = 0.0
    mlp: float = 0.0  # dense MLP (dense layers) or shared experts (MoE layers)
    elementwise: float = 0.0
    experts: float = 0.0
    dispatch: float = 0.0
    combine: float = 0.0

    @property
    def attn(self) -> float:
        """Everything but the routed experts: the compute that overlaps dispatch/combine around attention."""
        return self.attn_proj + self.attn_core + self.mlp + self.elementwise

    @property
    def compute(self) -> float:
        return self.attn + self.experts

    @property
    def comm(self) -> float:
        return self.dispatch + self.combine


def layer_work(model: ModelSpec, gpu: GpuSpec, dep: Deployment, eff: Efficiency, tokens: float, seqs: float,
               context: float, cached: float, moe: bool, balancedness: float) -> LayerWork:
    """One layer, one micro-batch of `tokens` tokens from `seqs` sequences on one GPU.

    context: keys each new token attends to on average; cached: prefix tokens per sequence whose latent KV
    prefill must expand (MLA naive attention).
    """
    h, wb = model.hidden, model.weight_bytes
    gemm_peak = gpu.fp8_tflops if wb <= 1 else gpu.bf16_tflops
    act = tokens * h * 2 * 2  # read and write of BF16 hidden states around each block

    def gemm(params: float, rows: float) -> float:
        return roofline_s(2 * params * rows, params * wb + act, gemm_peak, eff.gemm, gpu, eff)

    w = LayerWork()
    w.attn_proj = gemm(model.attn_params + model.gate_params * moe, tokens)
    if cached and model.kv_b_params:
        w.attn_proj += gemm(model.kv_b_params, seqs * cached)
    kv_read = seqs * (cached if dep.phase == "prefill" else context) * model.kv_bytes_per_token_layer
    attn_flops = model.pair_flops(dep.phase) * tokens * context
    w.attn_core = roofline_s(attn_flops, kv_read, gpu.bf16_tflops, eff.attn, gpu, eff)
    # norms, residual adds, RoPE, quantization: ~12 BF16 passes over the hidden state per token
    elementwise_bytes = tokens * 12 * 2 * h
    if not moe:
        w.mlp = gemm(model.dense_mlp_params, tokens)
        w.elementwise = elementwise_bytes / (gpu.hbm_tbps * 1e12 * eff.mem)
        return w
    if model.shared_params:
        w.mlp = gemm(model.shared_params, tokens)
    local_experts = (model.num_experts + dep.redundant) / dep.ep if dep.eplb else model.num_experts / dep.ep
    pairs = tokens * model.topk / balancedness  # (token, expert) pairs on the busiest GPU
    touched = min(local_experts, pairs)
    # weights; FP8 in, BF16 mid and out
    expert_bytes = touched * model.expert_params * wb + pairs * h * (1 + 2 + 2)
    w.experts = roofline_s(2 * model.expert_params * pairs, expert_bytes, gemm_peak, eff.gemm, gpu, eff)
    # per routed pair on the busiest GPU: FP8 row scattered to expert order (read + write), SiLU*mul over
    # 2I -> I in BF16 plus FP8 requantization, BF16 output gathered back and weighted
    pair_bytes = 2 * h + 2 * 2 * model.moe_intermediate + 2 * model.moe_intermediate + 2 * 2 * h
    w.elementwise = (elementwise_bytes + pairs * pair_bytes) / (gpu.hbm_tbps * 1e12 * eff.mem)
    w.dispatch = comm_s(tokens, h + h / 32 + 16, model, gpu, dep, eff, balancedness)
    w.combine = comm_s(tokens, 2 * h, model, gpu, dep, eff, balancedness)
    return w


def moe_layer_s(w: LayerWork, dep: Deployment, gpu: GpuSpec, eff: Efficiency, micro_batches: int) -> float:
    """Seconds of one MoE layer for the whole step, given one micro-batch's work."""
    if micro_batches == 1:
        return w.compute + w.comm
    slow_compute, slow_comm = tbo_slowdown(dep, gpu, eff)
    attn, experts = w.attn * slow_compute, w.experts * slow_compute
    dispatch, combine = w.dispatch * slow_comm, w.combine * slow_comm
    return max(attn, dispatch) + max(experts, dispatch) + max(experts, combine) + max(attn, combine)


def tbo_slowdown(dep: Deployment, gpu: GpuSpec, eff: Efficiency) -> tuple[float, float]:
    """(compute, communication) slowdown factors while two micro-batches overlap."""
    if dep.phase != "prefill" or not dep.tbo:
        return 1.0, 1.0
    sms = gpu.num_sms / (gpu.num_sms - eff.prefill_comm_sms)
    return sms * eff.prefill_tbo_interference, eff.prefill_tbo_interference


# ---------------------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------------------


def memory_gb(model: ModelSpec, gpu: GpuSpec, dep: Deployment) -> dict[str, float]:
    """Per-GPU memory: weights (DP attention, dense and shared parts replicated) and the decode KV cache."""
    wb = model.weight_bytes
    local = (model.num_experts + dep.redundant) / dep.ep if dep.eplb else model.num_experts / dep.ep
    gemm_params = (model.num_layers * model.attn_params + model.num_dense_layers * model.dense_mlp_params
                   + model.num_moe_layers * (model.shared_params + local * model.expert_params))
    weights = wb * gemm_params + 2 * 2 * model.head_params  # BF16 embedding and LM head
    kv = 0.0
    if dep.phase == "decode":
        kv = dep.batch_per_gpu * dep.context_len * model.kv_bytes_per_token_layer * model.num_layers
    return {"weights": weights / 1e9, "kv_cache": kv / 1e9, "capacity": gpu.hbm_gb}


@dataclass(frozen=True)
class StepShape:
    """What one GPU computes in one step: new tokens, from how many sequences, against how much context."""

    tokens: float  # new (computed) tokens
    seqs: float  # sequences they belong to
    context: float  # keys each new token attends to on average
    cached: float  # prefill: prefix tokens per sequence whose latent KV is expanded (0 in decode)
    out_tokens: float  # the step's yield: output tokens (decode), input tokens incl. cache hits (prefill)
    head_rows: float  # rows through the LM head: every token in decode, the last of each prompt in prefill


def step_shape(dep: Deployment) -> StepShape:
    """The step of dep's phase: a prefill of tokens_per_gpu new tokens, or a decode of batch_per_gpu sequences."""
    if dep.phase == "prefill":
        new_per_seq = dep.input_len * (1.0 - dep.cache_hit)
        cached = dep.input_len * dep.cache_hit
        tokens = float(dep.tokens_per_gpu)
        seqs = tokens / new_per_seq
        # causal: a new token sees its prefix and half the new tokens
        return StepShape(tokens=tokens, seqs=seqs, context=cached + new_per_seq / 2, cached=cached,
                         out_tokens=tokens / (1.0 - dep.cache_hit), head_rows=seqs)
    seqs = float(dep.batch_per_gpu)
    tokens = seqs * (1 + dep.mtp_draft)
    return StepShape(tokens=tokens, seqs=seqs, context=float(dep.context_len), cached=0.0,
                     out_tokens=seqs * (1 + dep.mtp_draft * dep.mtp_accept), head_rows=tokens)


@dataclass
class StepTime:
    """Seconds of one step on one GPU, by part, and the layer work they came from."""

    micro_batches: int
    dense: LayerWork  # one dense layer over the whole batch
    moe: LayerWork  # one MoE layer over one micro-batch
    layers: float  # all layers, overlap included
    head: float
    layer_overheads: float  # fixed, per layer and micro-batch
    step_overhead: float  # fixed, per step
    mtp: float

    @property
    def step(self) -> float:
        return self.layers + self.head + self.layer_overheads + self.mtp + self.step_overhead


def fixed_overheads(dep: Deployment, eff: Efficiency) -> tuple[float, float]:
    """Fixed time of dep's phase: (us per layer and micro-batch, ms per step)."""
    if dep.phase == "prefill":
        return eff.prefill_layer_overhead_us, eff.prefill_step_overhead_ms
    return eff.decode_layer_overhead_us, eff.decode_step_overhead_ms


def lm_head_s(model: ModelSpec, gpu: GpuSpec, eff: Efficiency, rows: float) -> float:
    """Seconds of the BF16 LM head over `rows` rows."""
    params = model.head_params
    return roofline_s(2 * params * rows, params * 2, gpu.bf16_tflops, eff.gemm, gpu, eff)


def mtp_s(model: ModelSpec, gpu: GpuSpec, dep: Deployment, eff: Efficiency, shape: StepShape,
          balancedness: float, layer_overhead_us: float) -> float:
    """Seconds of multi-token prediction (decode): per draft token the MTP block (one MoE layer) and the head."""
    if not dep.mtp_draft or dep.phase == "prefill":
        return 0.0
    micro = 2 if dep.tbo else 1
    seqs = shape.seqs / micro
    w = layer_work(model, gpu, dep, eff, seqs, seqs, shape.context, 0.0, moe=True, balancedness=balancedness)
    block = moe_layer_s(w, dep, gpu, eff, micro) + lm_head_s(model, gpu, eff, shape.seqs)
    return dep.mtp_draft * (block + micro * layer_overhead_us * 1e-6)


def step_time(model: ModelSpec, gpu: GpuSpec, dep: Deployment, eff: Efficiency, shape: StepShape,
              balancedness: float) -> StepTime:
    """Dense layers whole, MoE layers in micro-batches (two under TBO), then the head, MTP and overheads."""
    micro = 2 if dep.tbo else 1
    s, bal = shape, balancedness
    dense = layer_work(model, gpu, dep, eff, s.tokens, s.seqs, s.context, s.cached, moe=False,
                       balancedness=bal)
    moe = layer_work(model, gpu, dep, eff, s.tokens / micro, s.seqs / micro, s.context, s.cached, moe=True,
                     balancedness=bal)
    moe_layer = moe_layer_s(moe, dep, gpu, eff, micro)
    layer_overhead_us, step_overhead_ms = fixed_overheads(dep, eff)
    return StepTime(
        micro_batches=micro, dense=dense, moe=moe,
        layers=model.num_dense_layers * dense.compute + model.num_moe_layers * moe_layer,
        head=lm_head_s(model, gpu, eff, s.head_rows),
        layer_overheads=(model.num_dense_layers + model.num_moe_layers * micro) * layer_overhead_us * 1e-6,
        step_overhead=step_overhead_ms * 1e-3, mtp=mtp_s(model, gpu, dep, eff, s, bal, layer_overhead_us))


def breakdown_ms(model: ModelSpec, gpu: GpuSpec, dep: Deployment, eff: Efficiency,
                 t: StepTime) -> dict[str, float]:
    """Milliseconds per step by part; they add up to the step, what TBO hides counted as a negative part."""
    dense, moe = t.dense, t.moe
    n_dense, n_moe = model.num_dense_layers, model.num_moe_layers * t.micro_batches
    compute_parts = {
        "attention projections": n_dense * dense.attn_proj + n_moe * moe.attn_proj,
        "core attention": n_dense * dense.attn_core + n_moe * moe.attn_core,
        "dense MLP": n_dense * dense.mlp,
        "shared experts": n_moe * moe.mlp,
        "routed experts": n_moe * moe.experts,
        "elementwise": n_dense * dense.elementwise + n_moe * moe.elementwise,
        "LM head": t.head,
    }
    slow_compute, slow_comm = tbo_slowdown(dep, gpu, eff)
    if slow_compute > 1.0:
        compute_parts["TBO slowdown (SMs lent, contention)"] = n_moe * (
            (slow_compute - 1.0) * moe.compute + (slow_comm - 1.0) * moe.comm)
    comm_total = n_moe * moe.comm
    breakdown = {k: v * 1e3 for k, v in compute_parts.items()}
    breakdown["dispatch + combine (total)"] = comm_total * 1e3
    # what overlap hides: everything listed minus what the layers actually take
    hidden = sum(compute_parts.values()) + comm_total - (t.layers + t.head)
    breakdown["  of which hidden by TBO"] = -hidden * 1e3
    breakdown["MTP draft"] = t.mtp * 1e3
    breakdown["fixed overheads"] = (t.layer_overheads + t.step_overhead) * 1e3
    return {k: v for k, v in breakdown.items() if abs(v) > 1e-6 or k.startswith("dispatch")}


def step_warnings(gpu: GpuSpec, dep: Deployment, shape: StepShape, mem: dict[str, float]) -> list[str]:
    """What makes the deployment unlikely to run as modelled: memory over capacity, DeepEP's batch limit."""
    warnings = []
    if mem["weights"] + mem["kv_cache"] > 0.92 * gpu.hbm_gb:
        warnings.append(f"weights {mem['weights']:.1f} GB + KV {mem['kv_cache']:.1f} GB exceed ~92% of "
                        f"{gpu.hbm_gb:.0f} GB")
    micro_tokens = shape.tokens / (2 if dep.tbo else 1)
    if dep.dispatch_mode == "low_latency" and micro_tokens > 1024:
        warnings.append(f"{micro_tokens:.0f} tokens per micro-batch exceed DeepEP's low-latency limit (1024)")
    return warnings


def plan_step(model: ModelSpec, gpu: GpuSpec, dep: Deployment,
              eff: Efficiency = DEFAULT_EFFICIENCY) -> PlanResult:
    """Model one step on one GPU and return its time, throughput and breakdown."""
    dep.validate(model)
    if dep.balancedness is not None:
        bal, source = dep.balancedness, "given"
    else:
        bal, source = estimate_balancedness(model, dep)
    shape = step_shape(dep)
    t = step_time(model, gpu, dep, eff, shape, bal)
    per_gpu = shape.out_tokens / t.step
    mem = memory_gb(model, gpu, dep)
    return PlanResult(
        phase=dep.phase, step_ms=t.step * 1e3, tokens_per_step=shape.out_tokens, tokens_per_s_gpu=per_gpu,
        tokens_per_s_node=per_gpu * min(dep.gpus_per_node, dep.num_gpus),
        tokens_per_s_total=per_gpu * dep.num_gpus,
        balancedness=bal, balancedness_source=source, breakdown_ms=breakdown_ms(model, gpu, dep, eff, t),
        memory_gb=mem, warnings=step_warnings(gpu, dep, shape, mem))
