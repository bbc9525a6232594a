"""Default balancedness for the step-time model: EPLB simulated on the synthetic workload at the plan's size.

The synthetic workload is `moeserve eplb synth`'s default (Zipf 0.55 popularity over experts, independent
per layer, slow drift) with prefill tokens drawn in whole sequences that route alike (seq_sigma 1.0, see
workloads.py). That per-sequence noise is what makes prefill, a few long prompts per GPU, less balanced
than decode. Its size (1.0) is a guess, not a fit: with it the model puts SGLang's 4K prefill with EPLB
10% below the same run with perfect balance, where the LMSYS blog measured 15% (plan_calibration.py). Measure
and pass --balancedness (from `moeserve eplb simulate` on a recorded dump) when you have a real workload.
"""

from __future__ import annotations

from functools import lru_cache

from moeserve.eplb.tools.plan_deployment import Deployment
from moeserve.eplb.tools.plan_models import ModelSpec

SYNTHETIC_SEQ_SIGMA = 1.0  # per-sequence routing noise of the default workload (see workloads.py)


@lru_cache(maxsize=256)
def synthetic_balancedness(num_experts: int, topk: int, num_groups: int, nodes: int, gpus_per_node: int,
                           redundant: int, tokens_per_gpu: int, seq_len: int, eplb: bool) -> float:
    """Balancedness of the default synthetic workload (4 layers, 16 steps) at one dispatch size.

    EPLB: planned on each quarter of the steps and scored on the next (held out); else the plain layout.
    """
    import numpy as np

    from moeserve.eplb.tools.simulate import PlacementCache, PlainLayout, simulate_one, step_time_balancedness
    from moeserve.eplb.tools.workloads import WorkloadSpec, generate

    num_gpus = nodes * gpus_per_node
    spec = WorkloadSpec(num_layers=4, num_experts=num_experts, num_steps=16,
                        tokens_per_step=tokens_per_gpu * num_gpus, topk=topk, num_groups=num_groups,
                        seq_len=seq_len, seq_sigma=SYNTHETIC_SEQ_SIGMA)
    counts = generate(spec)
    if not eplb:
        return step_time_balancedness(PlainLayout(num_experts, num_gpus).loads(counts))[0]
    cache = PlacementCache(counts, num_groups, 4)
    midpoints = np.arange(spec.num_steps) + 0.5
    return float(simulate_one(counts, midpoints, cache, nodes, gpus_per_node, redundant)["eplb_held_out"])


def estimate_balancedness(model: ModelSpec, dep: Deployment) -> tuple[float, str]:
    """Balancedness of the default synthetic workload (`eplb synth` defaults) at this deployment.

    Scored per dispatch: one micro-batch's tokens on every GPU of the EP group; in prefill the tokens come
    in whole sequences (chunks of at most one micro-batch), which route alike.
    """
    micro = 2 if dep.tbo else 1
    if dep.phase == "prefill":
        tokens = max(1, round(dep.tokens_per_gpu / micro))
        seq_len = max(1, min(tokens, round(dep.input_len * (1.0 - dep.cache_hit))))
    else:
        tokens = max(1, round(dep.batch_per_gpu * (1 + dep.mtp_draft) / micro))
        seq_len = 1
    nodes = dep.ep_nodes
    gpn = dep.ep // nodes
    groups = model.num_groups if model.num_experts % max(model.num_groups, 1) == 0 else 1
    bal = synthetic_balancedness(model.num_experts, model.topk, groups, nodes, gpn, dep.redundant, tokens,
                                 seq_len, dep.eplb)
    kind = "EPLB held out" if dep.eplb else "no EPLB"
    return bal, f"synthetic zipf workload, {kind}, {tokens} tokens/GPU per dispatch"
