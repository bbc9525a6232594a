"""moeserve's CPU experts kernel (moeserve/kernels/cpu_experts.py) against a per-row reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.core.layouts import ContiguousLayout
from moeserve.kernels import cpu_experts
from moeserve.layers.moe.experts import Experts

GEN = torch.Generator().manual_seed(1)

pytestmark = pytest.mark.skipif(cpu_experts.load() is None, reason="no C++ compiler: the kernel cannot build")


def _transposed(w: torch.Tensor) -> torch.Tensor:
    """Logical shape kept, stored transposed: how Experts keeps CPU weights."""
    return w.transpose(1, 2).contiguous().transpose(1, 2)


def _layout(counts: list[int], H: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.randn(int(offsets[-1]), H, generator=GEN)
    return x, offsets, torch.tensor(counts, dtype=torch.int32)


def _weights(E: int, H: int, inter: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Random w13 [E, 2I, H] and w2 [E, H, I] at unit output scale, stored transposed."""
    w13 = torch.randn(E, 2 * inter, H, generator=GEN) * H**-0.5
    w2 = torch.randn(E, H, inter, generator=GEN) * inter**-0.5
    return _transposed(w13.to(dtype)), _transposed(w2.to(dtype))


def _reference(x, w13, w2, offsets, counts) -> torch.Tensor:
    """Each row through its expert, one row at a time, in float64."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for e, n in enumerate(counts.tolist()):
        for r in range(int(offsets[e]), int(offsets[e]) + n):
            h = w13[e].double() @ x[r].double()
            out[r] = w2[e].double() @ (F.silu(h[:inter]) * h[inter:])
    return out


@pytest.mark.parametrize(("H", "inter"), [(64, 32), (40, 20), (136, 72), (256, 128)])
@pytest.mark.parametrize("counts", [[1, 0, 9, 2, 3], [4, 4, 4, 4, 4], [0, 0, 1, 0, 0], [5, 6, 11, 16, 13]])
def test_kernel_matches_reference(H, inter, counts):
    """Row blocks of 1-4 and their remainders, empty experts, column counts that are not a multiple of 8 or 64."""
    E = len(counts)
    x, offsets, n = _layout(counts, H)
    w13, w2 = _weights(E, H, inter)
    got = cpu_experts.cpu_experts(x, w13, w2, offsets, n)
    torch.testing.assert_close(got.double(), _reference(x, w13, w2, offsets, n), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_random_shapes_match_reference(seed):
    """Fresh random sizes: experts, widths and 0-32 rows each (every row-block size and its remainders)."""
    gen = torch.Generator().manual_seed(100 + seed)
    E, H, inter = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((1, 9), (8, 200), (4, 150)))
    counts = torch.randint(0, cpu_experts.MAX_ROWS_PER_EXPERT + 1, (E,), generator=gen).tolist()  # the kernel runs
    x, offsets, n = _layout(counts, H)
    w13, w2 = _weights(E, H, inter)
    got = cpu_experts.cpu_experts(x, w13, w2, offsets, n)
    torch.testing.assert_close(got.double(), _reference(x, w13, w2, offsets, n), rtol=1e-5, atol=1e-5)


def test_bf16_weights_sum_in_fp32():
    """bf16 weights and activations: the kernel's fp32 sums equal the fp64 reference up to the output rounding."""
    E, H, inter, counts = 4, 96, 64, [3, 1, 0, 6]
    x, offsets, n = _layout(counts, H)
    x = x.bfloat16()
    w13, w2 = _weights(E, H, inter, torch.bfloat16)
    got = cpu_experts.cpu_experts(x, w13, w2, offsets, n)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), _reference(x, w13, w2, offsets, n), rtol=1e-2, atol=1e-2)


def test_many_rows_per_expert_take_the_grouped_gemm():
    """Past MAX_ROWS_PER_EXPERT rows per expert on average the grouped GEMM runs: the same results."""
    E, H, inter = 2, 32, 16
    counts = [cpu_experts.MAX_ROWS_PER_EXPERT * E + 5, 3]
    x, offsets, n = _layout(counts, H)
    w13, w2 = _weights(E, H, inter)
    got = cpu_experts.cpu_experts(x, w13, w2, offsets, n)
    torch.testing.assert_close(got.double(), _reference(x, w13, w2, offsets, n), rtol=1e-5, atol=1e-5)


def test_untransposed_weights_are_refused():
    x, offsets, n = _layout([2, 1], 16)
    w13, w2 = torch.randn(2, 16, 16), torch.randn(2, 16, 8)
    with pytest.raises(ValueError, match="stored transposed"):
        cpu_experts.cpu_experts(x, w13, w2, offsets, n)


def test_compiled_call_is_the_custom_op():
    E, H, inter, counts = 3, 32, 16, [2, 0, 5]
    x, offsets, n = _layout(counts, H)
    w13, w2 = _weights(E, H, inter)
    fn = torch.compile(lambda *a: cpu_experts.cpu_experts(*a) * 2, fullgraph=True)
    torch.testing.assert_close(fn(x, w13, w2, offsets, n), cpu_experts.cpu_experts(x, w13, w2, offsets, n) * 2)


def _loaded_experts(backend: str, dtype: torch.dtype = torch.float32) -> Experts:
    ex = Experts(32, 16, 4, list(range(4)), runner_backend=backend).to(dtype)
    with torch.no_grad():
        ex.w13.copy_(torch.randn(ex.w13.shape, generator=GEN) * 32**-0.5)
        ex.w2.copy_(torch.randn(ex.w2.shape, generator=GEN) * 16**-0.5)
    ex.process_weights_after_loading(torch.device("cpu"))
    return ex


@pytest.mark.parametrize(("backend", "uses_kernel"), [("auto", True), ("cpu_kernel", True), ("grouped_gemm", False)])
def test_backends_choose_and_agree(backend, uses_kernel):
    ex = _loaded_experts(backend)
    assert ex.use_cpu_kernel is uses_kernel
    assert ex.w13.transpose(1, 2).is_contiguous()  # both CPU kernels take the transposed layout
    x, offsets, n = _layout([3, 0, 2, 4], 32)
    got = ex(ContiguousLayout(x=x, expert_offsets=offsets, num_tokens_per_expert=n))
    torch.testing.assert_close(got.double(), _reference(x, ex.w13, ex.w2, offsets, n), rtol=1e-5, atol=1e-5)


def test_cpu_kernel_backend_names_what_it_cannot_run():
    assert not cpu_experts.available(torch.float16)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        _loaded_experts("cpu_kernel", torch.float16)
    assert _loaded_experts("auto", torch.float16).use_cpu_kernel is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_rank_moe_equals_dispatcher_path(dtype):
    """cpu_moe_local (grouping, experts and the weighted sum in one call) against the per-row reference summed
    token by token; the expert counts are the pairs each expert computed."""
    T, k, E, H, inter = 9, 3, 6, 48, 40
    x = torch.randn(T, H, generator=GEN).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=GEN)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=GEN)
    w13, w2 = _weights(E, H, inter, dtype)
    got, counts = cpu_experts.cpu_moe_local(x, ids, weights, w13, w2)
    assert got.dtype == dtype and counts.tolist() == torch.bincount(ids.flatten(), minlength=E).tolist()
    one = (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32))  # a single-row layout
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for t in range(T):
        want = sum(float(weights[t, j]) * _reference(x[t:t + 1], w13[e:e + 1], w2[e:e + 1], *one)[0]
                   for j, e in enumerate(ids[t].tolist()))
        torch.testing.assert_close(got[t].double(), want, rtol=tol, atol=tol)


def test_one_rank_moe_refuses_bad_expert_ids():
    x = torch.randn(2, 16)
    w13, w2 = _weights(3, 16, 8)
    with pytest.raises(ValueError, match="outside"):
        cpu_experts.cpu_moe_local(x, torch.tensor([[0, 3], [1, 2]]), torch.rand(2, 2), w13, w2)
