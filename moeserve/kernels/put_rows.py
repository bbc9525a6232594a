"""Row puts with a device-side count: the copy a one-sided dispatcher makes into a peer's receive buffer.

    put_rows(src [N, W], index [M] int64 | None, count [1] int, dst [M, W]) -> None
        dst[j] = src[index[j]] (src[j] without an index) for j < count; rows of dst past count are not written and
        rows of src not named are not read

`count` stays on the device: the Triton kernel (triton_ops/put_rows.py, CUDA tensors) launches M row programs and
those past the count return at once, so no host sync and a CUDA graph can capture it, while the bytes that move are
count x W. `dst` may be a view of another GPU's memory (torch's symmetric memory). The reference reads the count
back to the host, which costs nothing on a CPU (where dst is shared memory of another process).
"""

from __future__ import annotations

import torch

from moeserve.kernels.triton_available import use_triton


def put_rows_reference(src: torch.Tensor, index: torch.Tensor | None, count: torch.Tensor, dst: torch.Tensor) -> None:
    n = int(count.reshape(-1)[0])
    dst[:n] = src[:n] if index is None else src.index_select(0, index[:n])


def put_rows(src: torch.Tensor, index: torch.Tensor | None, count: torch.Tensor, dst: torch.Tensor) -> None:
    """Module docstring. Triton on CUDA, the reference elsewhere."""
    assert src.shape[1:] == dst.shape[1:] and src.dtype == dst.dtype, (src.shape, dst.shape, src.dtype, dst.dtype)
    assert index is None or index.shape[0] <= dst.shape[0]
    if use_triton(src) and dst.shape[0] > 0:
        from moeserve.kernels.triton_ops.put_rows import put_rows as triton_put_rows

        triton_put_rows(src, index, count, dst)
        return
    put_rows_reference(src, index, count, dst)
