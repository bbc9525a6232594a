"""A verify step run as decode rows: each request's k + 1 tokens become k + 1 one-token "requests" over the same
slots, row j at position L + j reading the first L + j + 1 of them (its own KV, written first, included). A round's
draft extend over the last round's accepted tokens (1 to k + 1 per request, round.py) runs the same way, so that
the draft's graphs (draft_graphs.py) replay it too.

Causal attention over [0, L + j] is exactly what the extend over [L, L + k] gives that row, so the logits are the
same; what changes is the path. A DECODE step runs MLA's absorbed form over the latent cache (one query row
against c_kv), where an EXTEND expands the request's whole prefix through kv_b_proj per step: at batch 1 on a CPU
the verify extend cost about twice a plain decode step. The MoE and dense layers see the same B * (k + 1) rows.

The rows' slot lists overlap (row j's is row j - 1's plus one slot), so kv_indices grows to about
(k + 1) * sum(L) entries: slots only, no KV is copied. The padded block the torch and Triton kernels read
(decode_slots, [B * (k + 1), max L + k + 1]) is each request's block repeated, row j masked past L + j + 1 by its
length: a decode step's shapes, which the verify's CUDA graphs capture. The CPU kernel reads kv_indices in place.
"""

from __future__ import annotations

import torch

from moeserve.core.forward_batch import ForwardBatch, ForwardMode
from moeserve.layers.attention.ops import padded_kv_slots


def verify_as_decode(fb: ForwardBatch, num_rows: int) -> ForwardBatch:
    """fb: a verify step as the scheduler builds it (EXTEND, num_rows = k + 1 tokens per request, host tensors)
    -> a DECODE batch of B * num_rows rows in fb's token order (extend_as_decode)."""
    assert all(n == num_rows for n in fb.extend_lens_cpu), (fb.extend_lens_cpu, num_rows)
    return extend_as_decode(fb)


def extend_as_decode(fb: ForwardBatch) -> ForwardBatch:
    """fb: an EXTEND batch on the host (any extend lengths) -> a DECODE batch of one row per token in fb's token
    order: the same tokens, positions and written slots; row j of request b reads b's first prefix_b + j + 1 slots.
    The lock-step header (global_num_tokens, any_extend) is fb's: the token count is unchanged, and keeping
    any_extend keeps the EP dispatch mode the extend had."""
    i64 = torch.int64
    n = fb.extend_lens.to(i64)
    total_rows = int(fb.qo_indptr[-1])
    seq = torch.tensor(fb.seq_lens_cpu, dtype=i64)
    lens = fb.positions.to(i64) + 1  # a row reads the slots up to its own position
    starts = torch.repeat_interleave(fb.kv_indptr[:-1], n, output_size=total_rows)  # each row's slots begin at b's
    row_indptr = torch.zeros(total_rows + 1, dtype=i64)
    row_indptr[1:] = torch.cumsum(lens, 0)
    # entry e of row r is slot kv_indices[starts[r] + (e - row_indptr[r])]
    total = int(row_indptr[-1])
    shift = torch.repeat_interleave(starts - row_indptr[:-1], lens, output_size=total)
    kv_indices = fb.kv_indices[torch.arange(total, dtype=i64) + shift]
    rows = lens.tolist()
    out = ForwardBatch.build(ForwardMode.DECODE, fb.input_ids.numpy(), rows, [1] * len(rows), fb.out_cache_loc,
                             kv_indices, kv_pool=fb.kv_pool)
    out.global_num_tokens, out.any_extend = fb.global_num_tokens, fb.any_extend
    block, _ = padded_kv_slots(fb.kv_indices, fb.kv_indptr, seq, max(fb.seq_lens_cpu))
    out.decode_slots = torch.repeat_interleave(block, n, dim=0, output_size=total_rows)
    return out
