"""Prefill (extend) attention over packed, ragged requests, for GPUs: every request's new queries attend causally over
its whole sequence (cached prefix + new tokens) in one launch, with no padding, no grouping and no copies.

    extend_attention(q [T, Hq, D], k [S, Hkv, D], v [S, Hkv, Dv], seqs [B, 4] int32, max_extend, scale,
                     q_rope=None, k_rope=None, sliding_window=None) -> [T, Hq, Dv]

seqs holds one row per request: (first row of its queries in q, its number of new tokens n_b, first row of its
sequence in k and v, its sequence length s_b); its query i sits at position s_b - n_b + i and sees the keys at
positions <= its own (and, with a sliding window w, > its own - w). max_extend is max n_b (the host knows it).
Hq is a multiple of Hkv (GQA/MQA: query head h reads KV head h // (Hq / Hkv)).

MLA's heads come in two parts, and they stay apart: q_rope [T, Hq, R] beside q, and k_rope [S, R] (one rope key
per token, shared by every head) or [S, Hkv, R] beside k. The scores are q . k + q_rope . k_rope. So the latent's
expansion hands over views of kv_b_proj's output (k_nope and v are column ranges of one tensor) and its rope key
once, where SDPA needs [S, H, D + R] built by a concatenation of the rope key repeated per head.

The Triton kernel (triton_ops/extend_attention.py) runs on CUDA: flash attention's online softmax over blocks of
keys, one program per (block of a request's queries, query head), blocks below the causal diagonal without a
mask. `extend_attention_reference` (the same signature) runs everywhere else and is what the tests compare with;
the serving path on CPU is layers/attention/ops.py's SDPA over padded groups.
"""

from __future__ import annotations

import torch

from moeserve.kernels.triton_available import use_triton


def extend_seqs(extend_lens: list[int], seq_lens: list[int], device: torch.device | str) -> torch.Tensor:
    """The kernels' seqs table [B, 4] int32 from the host lengths (q rows and k/v rows packed in request order)."""
    rows, q0, k0 = [], 0, 0
    for n, s in zip(extend_lens, seq_lens, strict=True):
        rows.append((q0, n, k0, s))
        q0 += n
        k0 += s
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 4).to(device, non_blocking=True)


def extend_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: torch.Tensor,
                               max_extend: int, scale: float, q_rope: torch.Tensor | None = None,
                               k_rope: torch.Tensor | None = None,
                               sliding_window: int | None = None) -> torch.Tensor:
    del max_extend  # the kernels' grid; the reference reads the lengths themselves
    T, Hq = q.shape[:2]
    Hkv = k.shape[1]
    if q_rope is not None:
        k_rope = k_rope if k_rope.dim() == 3 else k_rope[:, None, :].expand(-1, Hkv, -1)
        q, k = torch.cat((q, q_rope), -1), torch.cat((k, k_rope.to(k.dtype)), -1)
    acc = torch.promote_types(q.dtype, torch.float32)
    out = q.new_zeros(T, Hq, v.shape[-1])
    for q0, n, k0, s in seqs.tolist():
        if n == 0:
            continue
        qb = q[q0:q0 + n].transpose(0, 1)  # [Hq, n, D]
        kb = k[k0:k0 + s].transpose(0, 1).repeat_interleave(Hq // Hkv, 0)  # [Hq, s, D]
        vb = v[k0:k0 + s].transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
        scores = torch.matmul(qb, kb.transpose(1, 2)).to(acc) * scale  # [Hq, n, s]
        pos = torch.arange(s - n, s, device=q.device)[:, None]
        key = torch.arange(s, device=q.device)[None, :]
        seen = key <= pos
        if sliding_window is not None:
            seen &= key > pos - sliding_window
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1).to(q.dtype)
        out[q0:q0 + n] = torch.matmul(probs, vb).transpose(0, 1)
    return out


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: torch.Tensor, max_extend: int,
                     scale: float, q_rope: torch.Tensor | None = None, k_rope: torch.Tensor | None = None,
                     sliding_window: int | None = None) -> torch.Tensor:
    """Module docstring. Triton on CUDA, the reference elsewhere (and under torch.compile)."""
    if use_triton(q) and not torch.compiler.is_compiling():
        from moeserve.kernels.triton_ops.extend_attention import extend_attention as triton_extend_attention

        return triton_extend_attention(q, k, v, seqs, max_extend, scale, q_rope, k_rope, sliding_window)
    return extend_attention_reference(q, k, v, seqs, max_extend, scale, q_rope, k_rope, sliding_window)
