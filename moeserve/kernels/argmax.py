"""The sampler's choice of a token: each row's argmax of the scores, or no token where the row has none.

    argmax_or_none(scores [B, V] float32, no_token) -> [B] int64: the first index of the row's maximum when
        that maximum is finite and the row holds no NaN; no_token where the row holds a NaN, its maximum is
        +inf, or it is all -inf

In torch that is four kernels a decode step (argmax, gather, isfinite, where), and torch's argmax reduces a
row in one block: over a ~102k-entry vocabulary at batch 1 it took 22 us on an H200, one SM reading 400 KB.
The Triton kernel (triton_ops/argmax.py) spreads each row over about a hundred programs and reduces their
partial maxima in a second launch, which also writes no_token: two launches, no host sync (CUDA-graph safe).
It runs for float32 CUDA matrices; the reference runs everywhere else, and under torch.compile.
"""

from __future__ import annotations

import torch

from moeserve.kernels.triton_available import use_triton


def argmax_or_none_reference(scores: torch.Tensor, no_token: int) -> torch.Tensor:
    best = scores.argmax(dim=-1)
    # torch's argmax takes the first NaN of a row that holds one, so a NaN row's winner is not finite either
    finite = torch.isfinite(scores.gather(1, best[:, None]).squeeze(1))
    return torch.where(finite, best, no_token)


def argmax_or_none(scores: torch.Tensor, no_token: int) -> torch.Tensor:
    """Module docstring: scores [B, V] float32 -> [B] int64, no_token where a row has no finite maximum."""
    if (use_triton(scores) and scores.dim() == 2 and scores.dtype == torch.float32 and scores.shape[1] >= 1
            and not torch.compiler.is_compiling()):
        from moeserve.kernels.triton_ops.argmax import argmax_or_none as triton_argmax_or_none

        return triton_argmax_or_none(scores, no_token)
    return argmax_or_none_reference(scores, no_token)
