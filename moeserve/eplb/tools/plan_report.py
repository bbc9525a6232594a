"""Text report of one planned step: deployment, throughput, breakdown and memory."""

from __future__ import annotations

from moeserve.eplb.tools.plan import Deployment, PlanResult
from moeserve.eplb.tools.plan_hardware import GpuSpec
from moeserve.eplb.tools.plan_models import ModelSpec


def format_plan(model: ModelSpec, gpu: GpuSpec, dep: Deployment, r: PlanResult) -> str:
    """A few lines a person reads: what runs where, tokens/s per GPU / node / total, and where time goes."""
    nodes = max(1, -(-dep.num_gpus // dep.gpus_per_node))
    groups = dep.num_gpus // dep.ep
    head = (
        f"{model.name} ({model.total_params / 1e9:.0f}B total, {model.active_params / 1e9:.1f}B active) on "
        f"{dep.num_gpus} x {gpu.name} ({nodes} node{'s' if nodes > 1 else ''} of {dep.gpus_per_node}), "
        f"EP{dep.ep}{f' x {groups} groups' if groups > 1 else ''}, "
        f"{dep.redundant if dep.eplb else 0} redundant experts{'' if dep.eplb else ' (no EPLB)'}, DP attention"
    )
    if r.phase == "decode":
        work = f"decode: {dep.batch_per_gpu} seq/GPU, context {dep.context_len}"
        work += f", MTP {dep.mtp_draft} draft at {dep.mtp_accept:.0%}" if dep.mtp_draft else ""
        unit = "output tok/s"
    else:
        work = f"prefill: {dep.tokens_per_gpu} tokens/GPU per step, inputs of {dep.input_len}"
        work += f", {dep.cache_hit:.0%} cache hits" if dep.cache_hit else ""
        unit = "input tok/s"
    lines = [
        head,
        f"{work}; {dep.dispatch_mode} dispatch, TBO {'on' if dep.tbo else 'off'}; balancedness {r.balancedness:.3f} "
        f"({r.balancedness_source})",
        f"  step {r.step_ms:.1f} ms -> {r.tokens_per_s_gpu:,.0f} {unit} per GPU, {r.tokens_per_s_node:,.0f} per node, "
        f"{r.tokens_per_s_total:,.0f} total",
        "  breakdown, ms per step:",
    ]
    lines += [f"    {name:36s} {ms:9.2f}" for name, ms in r.breakdown_ms.items()]
    mem = r.memory_gb
    lines.append(f"  memory per GPU: weights {mem['weights']:.1f} GB + KV cache {mem['kv_cache']:.1f} GB "
                 f"of {mem['capacity']:.0f} GB")
    lines += [f"  warning: {w}" for w in r.warnings]
    return "\n".join(lines) + "\n"
