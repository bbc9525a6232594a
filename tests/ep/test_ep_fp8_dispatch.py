"""FP8 dispatch of the low-latency mode on 2 CPU ranks: tokens travel in e4m3 with their per-128 scales. Both
transports: all2all's equal-split all-to-all and symm's row puts into shared memory.

Per-token quantization commutes with moving tokens, so the FP8 layout must hold exactly the quantized rows of the
bf16 layout (same masked_m, same rows), in a little over half of bf16's bytes; and combine (bf16) after experts
computed on the dequantized rows equals the one-process sum over each token's experts of those rows.
"""

from __future__ import annotations

import pytest
import torch
from ep_harness import run_ranks

from moeserve.ep.all2all_low_latency import LowLatencyDispatcher
from moeserve.ep.symm import SymmLowLatencyDispatcher
from moeserve.kernels.fp8_quant import dequantize_activations, quantize_activations_reference

pytestmark = pytest.mark.slow

H, E, K, CAP = 200, 4, 2, 8  # hidden 200: two scale groups, the second partial
TOKENS = (11, 5)  # rank 0 runs two rounds


def _inputs(rank: int):
    gen = torch.Generator().manual_seed(100 + rank)
    x = (torch.randn(TOKENS[rank], H, generator=gen) * 3).to(torch.bfloat16)
    ids = torch.rand(TOKENS[rank], E, generator=gen).argsort(1)[:, :K]
    return x, ids, torch.rand(TOKENS[rank], K, generator=gen) + 0.1


def _expert(x: torch.Tensor, e: int) -> torch.Tensor:
    return torch.tanh(x.float() * (e + 1) * 0.1)


DISPATCHERS = {"all2all": LowLatencyDispatcher, "symm": SymmLowLatencyDispatcher}


def _run(rank: int, world: int, dispatcher: str):
    import torch.distributed as dist

    x, ids, weights = _inputs(rank)
    common = dict(num_experts=E, hidden_size=H, dtype=torch.bfloat16, device="cpu", ep_group=dist.group.WORLD,
                  ep_rank=rank, ep_size=world, topk=K, max_tokens_per_rank=CAP)
    cls = DISPATCHERS[dispatcher]
    plain = cls(**common)
    fp8 = cls(**common, fp8_quantize=quantize_activations_reference)
    plain.dispatch_a(x, ids, weights, None)
    ref = plain.dispatch_b()
    plain.combine_a(ref.x)
    plain.combine_b()
    fp8.dispatch_a(x, ids, weights, None)
    got = fp8.dispatch_b()
    bytes_fp8, bytes_bf16 = fp8.comm_bytes["dispatch"], plain.comm_bytes["dispatch"]
    e_local = E // world
    dq = dequantize_activations(got.x, got.x_scale)
    out = torch.stack([_expert(dq[e], rank * e_local + e) for e in range(e_local)]).to(torch.bfloat16)
    fp8.combine_a(out)
    y = fp8.combine_b()
    return _checks(rank, ref, got, y) | {"byte_ratio": bytes_fp8 / bytes_bf16}


def _checks(rank: int, ref, got, y) -> dict:
    """Plain values for the parent (tensors do not outlive the rank processes)."""
    rows_equal = True
    for e, m in enumerate(ref.masked_m.tolist()):
        q, s = quantize_activations_reference(ref.x[e, :m])
        rows_equal &= torch.equal(got.x[e, :m].view(torch.uint8), q.view(torch.uint8))
        rows_equal &= torch.equal(got.x_scale[e, :m], s)
    # combine: one process, every token's experts over the quantized rows
    x, ids, weights = _inputs(rank)
    dq = dequantize_activations(*quantize_activations_reference(x)).to(torch.bfloat16)
    want = sum(weights[:, j, None] * torch.stack([_expert(dq[t], int(ids[t, j])) for t in range(len(x))])
               for j in range(K))
    return {"fp8": got.x.dtype == torch.float8_e4m3fn, "scale_shape": tuple(got.x_scale.shape),
            "x_shape": tuple(got.x.shape), "masked_m_equal": torch.equal(got.masked_m, ref.masked_m),
            "rows_equal": rows_equal, "valid_rows": int(ref.masked_m.sum()),
            "combine_err": float((y.float() - want).abs().max()), "combine_max": float(want.abs().max())}


@pytest.mark.parametrize("dispatcher", list(DISPATCHERS))
def test_fp8_low_latency_dispatch(dispatcher):
    for r in run_ranks(2, _run, dispatcher):
        assert r["fp8"] and r["scale_shape"] == (*r["x_shape"][:2], 2)
        assert r["masked_m_equal"] and r["rows_equal"] and r["valid_rows"] > 0
        assert r["byte_ratio"] < 0.6  # e4m3 + 4 bytes per 128: about half of bf16
        assert r["combine_err"] <= 2e-2 * r["combine_max"]  # bf16 combine
