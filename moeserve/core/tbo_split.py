"""Two-batch overlap (TBO), part 1: when to overlap, and how one ForwardBatch becomes two micro-batches.

Split rule: micro-batch A takes the first ceil(T/2) new tokens of the step (rounded up to whole DECODE_LEN), B the rest.
- DECODE (DECODE_LEN tokens per request): A = the first ceil(B/2) requests, B = the rest (a split by sequences).
- EXTEND: token-balanced. The request that straddles the midpoint is cut in two: its first part (positions
  prefix .. prefix + n_A - 1) goes to A, its second part to B with prefix_len = prefix + n_A, the same seq_len and
  the same KV slots. B's part reads the KV that A's part writes: the executor runs A's attention of a layer before
  B's attention of the same layer, so those rows are in the cache when B reads them.
- MIXED (an extend with the running decodes last, DECODE_LEN tokens each): token-balanced like EXTEND; a decode is
  never cut (with DECODE_LEN > 1: while the extend tokens are a multiple of it), so each micro-batch holds a tail of
  the decodes or none: it stays MIXED with its own num_decodes and its rows of decode_slots.
- IDLE, or a side with no tokens: an IDLE micro-batch (it still joins every collective).

Because the cut is a fixed fraction of the token count, every rank knows every other rank's micro-batch sizes from
the lock-step header alone: micro-batch A's header is [ceil(t/2) for t in global_num_tokens], B's [t // 2]. The
EP dispatchers size their buffers / rounds from it, so no extra communication is needed.

The two parts are contiguous token ranges [0, s) and [s, T), so merging hidden states (or all-token logits) back is
`torch.cat([a, b])`; with the default logits rows (last token of each request), A's rows followed by B's rows are
the parent's rows in order (a cut request has its last token in B). `merge_rows` does it for any row set.

Decision (`should_use_tbo`): every rank must take the same path (a TBO layer issues twice the collectives), so it
depends only on the header, the same list on every rank: enabled and max(global_num_tokens) >= tbo_token_threshold.
A rank with no tokens then runs two IDLE micro-batches. Without a header (one rank, no lock-step) the local token
count decides; a multi-rank run without a header never overlaps (the ranks could disagree).
"""

from __future__ import annotations

import dataclasses

import torch

from moeserve.core.forward_batch import DECODE_LEN, ForwardBatch


def should_use_tbo(batch: ForwardBatch, enabled: bool, threshold: int, world_size: int = 1) -> bool:
    """Whether this step runs as two micro-batches. The same answer on every rank (see the module doc)."""
    if not enabled:
        return False
    if batch.global_num_tokens:
        return max(batch.global_num_tokens) >= max(threshold, 1)
    if world_size > 1:
        return False
    return batch.num_tokens >= max(threshold, 1)


def split_point(num_tokens: int) -> int:
    """Tokens [0, s) go to micro-batch A, [s, T) to B: half, rounded up to whole decodes (DECODE_LEN tokens)."""
    half = (num_tokens + 1) // 2
    return min(-(-half // DECODE_LEN) * DECODE_LEN, num_tokens)


def micro_headers(global_num_tokens: list[int] | None) -> tuple[list[int] | None, list[int] | None]:
    """The lock-step headers of micro-batches A and B (exact per-rank token counts, see split_point)."""
    if global_num_tokens is None:
        return None, None
    return [split_point(t) for t in global_num_tokens], [t - split_point(t) for t in global_num_tokens]


def _idle_like(batch: ForwardBatch, header: list[int] | None) -> ForwardBatch:
    out = ForwardBatch.idle(batch.kv_pool, batch.input_ids.device)  # made on the device: no copy (graph capture)
    out.global_num_tokens, out.any_extend = header, batch.any_extend
    out.return_all_logits = batch.return_all_logits
    return out


def split_batch(batch: ForwardBatch) -> tuple[ForwardBatch, ForwardBatch]:
    """Micro-batches A and B of `batch` (see the module doc). Host-side bookkeeping only: no device sync."""
    T = batch.num_tokens
    s = split_point(T)
    head_a, head_b = micro_headers(batch.global_num_tokens)
    if T == 0 or batch.mode.is_idle:
        return _idle_like(batch, head_a), _idle_like(batch, head_b)
    if batch.mode.is_decode and batch.decode_slots is not None:
        return _split_decode(batch, s // DECODE_LEN, head_a, head_b)
    ext, seq, pre = batch.extend_lens_cpu, batch.seq_lens_cpu, batch.prefix_lens_cpu
    B = len(ext)
    qo = [0] * (B + 1)
    kv = [0] * (B + 1)
    for b in range(B):
        qo[b + 1] = qo[b] + ext[b]
        kv[b + 1] = kv[b] + seq[b]
    # request j is the first one not entirely in A (qo[j + 1] > s); it is cut when it starts before s
    j = next((b for b in range(B) if qo[b + 1] > s), B)
    cut = j < B and qo[j] < s
    n_a = s - qo[j] if cut else 0  # tokens of request j that go to A

    # A: requests [0, j) whole, plus the first n_a tokens of request j
    a_ext, a_seq, a_pre = ext[:j], seq[:j], pre[:j]
    b_ext, b_seq, b_pre = ext[j:], seq[j:], pre[j:]
    a_kv_end = kv[j]
    if cut:
        a_ext, a_seq, a_pre = a_ext + [n_a], a_seq + [pre[j] + n_a], a_pre + [pre[j]]
        b_ext = [ext[j] - n_a] + b_ext[1:]
        b_pre = [pre[j] + n_a] + b_pre[1:]
        a_kv_end = kv[j] + pre[j] + n_a
    a_req, b_req = (slice(0, j + 1) if cut else slice(0, j)), slice(j, B)
    assert not (cut and (batch.mode.is_decode or j >= B - batch.num_decodes)), "a decode is never cut in two"

    def part(tok: slice, req: slice, kv_rows: slice, e: list[int], sq: list[int], pf: list[int],
             header: list[int] | None) -> ForwardBatch:
        if not e:
            return _idle_like(batch, header)
        dev = batch.input_ids.device
        i64 = torch.int64
        qo_p = [0]
        kv_p = [0]
        for n, L in zip(e, sq, strict=True):
            qo_p.append(qo_p[-1] + n)
            kv_p.append(kv_p[-1] + L)
        logits_rows = None
        if not batch.return_all_logits:
            # the last token of every request whose last token is in this part (A's cut request has none)
            logits_rows = [qo_p[i + 1] - 1 for i in range(len(e))
                           if e[i] > 0 and not (cut and req is a_req and i == len(e) - 1)]
            logits_rows = torch.tensor(logits_rows, dtype=i64).to(dev, non_blocking=True)
        decode_slots = batch.decode_slots[req] if batch.decode_slots is not None else None
        num_decodes = 0
        if batch.mode.is_mixed:  # the parent's decodes are its requests [B - D, B); this part's are [lo, hi)
            first_decode = B - batch.num_decodes
            lo, hi = max(req.start, first_decode), min(req.stop, B)
            num_decodes = max(hi - lo, 0)
            decode_slots = None
            if num_decodes and batch.decode_slots is not None:
                decode_slots = batch.decode_slots[lo - first_decode:hi - first_decode]
        return ForwardBatch(
            mode=batch.mode,
            input_ids=batch.input_ids[tok],
            positions=batch.positions[tok],
            seq_lens=torch.tensor(sq, dtype=i64).to(dev, non_blocking=True),
            extend_lens=torch.tensor(e, dtype=i64).to(dev, non_blocking=True),
            prefix_lens=torch.tensor(pf, dtype=i64).to(dev, non_blocking=True),
            out_cache_loc=batch.out_cache_loc[tok],
            kv_indices=batch.kv_indices[kv_rows],
            kv_indptr=torch.tensor(kv_p, dtype=i64).to(dev, non_blocking=True),
            qo_indptr=torch.tensor(qo_p, dtype=i64).to(dev, non_blocking=True),
            kv_pool=batch.kv_pool,
            seq_lens_cpu=list(sq), extend_lens_cpu=list(e), prefix_lens_cpu=list(pf),
            global_num_tokens=header, any_extend=batch.any_extend,
            logits_indices=logits_rows, return_all_logits=batch.return_all_logits,
            decode_slots=decode_slots, num_decodes=num_decodes,
        )

    a = part(slice(0, s), a_req, slice(0, a_kv_end), a_ext, a_seq, a_pre, head_a)
    b = part(slice(s, T), b_req, slice(kv[j], kv[B]), b_ext, b_seq, b_pre, head_b)
    return a, b


def _split_decode(batch: ForwardBatch, a: int, head_a: list[int] | None, head_b: list[int] | None
                  ) -> tuple[ForwardBatch, ForwardBatch]:
    """A decode batch with its slot block (the scheduler's, a padded static-shape step's, a CUDA graph's): requests
    [0, a) and [a, B), from views of its tensors and device arithmetic only, so that a captured decode step can
    overlap its two halves (no host tensor is made, nothing is copied to the device). B keeps the whole
    kv_indices with its own rows of kv_indptr (the kernels read request b's slots at kv_indptr[b] .. [b + 1])."""
    B, s = batch.batch_size, a * DECODE_LEN
    if a >= B:
        return dataclasses.replace(batch, global_num_tokens=head_a), _idle_like(batch, head_b)
    rows = (slice(0, a), slice(a, B))
    toks = (slice(0, s), slice(s, B * DECODE_LEN))
    qo = (batch.qo_indptr[: a + 1], batch.qo_indptr[a:] - s)
    kv = (batch.kv_indptr[: a + 1], batch.kv_indptr[a:])
    parts = []
    for i, header in enumerate((head_a, head_b)):
        r, t = rows[i], toks[i]
        parts.append(dataclasses.replace(
            batch, input_ids=batch.input_ids[t], positions=batch.positions[t], out_cache_loc=batch.out_cache_loc[t],
            seq_lens=batch.seq_lens[r], extend_lens=batch.extend_lens[r], prefix_lens=batch.prefix_lens[r],
            kv_indptr=kv[i], qo_indptr=qo[i], decode_slots=batch.decode_slots[r],
            seq_lens_cpu=batch.seq_lens_cpu[r], extend_lens_cpu=batch.extend_lens_cpu[r],
            prefix_lens_cpu=batch.prefix_lens_cpu[r], global_num_tokens=header,
            logits_indices=None if batch.return_all_logits else qo[i][1:] - 1, static_bs=None))
    return parts[0], parts[1]


def merge_rows(parent: ForwardBatch, a_rows: torch.Tensor, b_rows: torch.Tensor) -> torch.Tensor:
    """Per-token outputs of A and B (hidden states, or all-token logits) -> the parent's token order."""
    del parent
    return torch.cat([a_rows, b_rows], dim=0)


__all__ = ["merge_rows", "micro_headers", "should_use_tbo", "split_batch", "split_point"]
