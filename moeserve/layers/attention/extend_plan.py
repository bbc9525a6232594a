"""Prefill (extend) attention batched over requests: one SDPA call per group of requests, no loop per request.

A step's requests have n_b new queries (positions s_b - n_b .. s_b - 1) over s_b keys (cached prefix + new tokens).
`ExtendPlan.build` (once per step, on the host, from the host lengths) sorts the requests by s_b and cuts them into
groups; each group runs as one padded batch q [B, H, Lq, D], k/v [B, Hkv, Lk, D], Lq = max n_b, Lk = max s_b:
- grouping: requests join the current group while its padded area B * Lq * Lk stays within PAD_FACTOR times the
  real area sum(n_b * s_b), or under SMALL_AREA (small groups are launch-bound: padding is cheaper than a launch).
  A 4000-token prompt beside 60 short ones therefore runs as two groups, not 61 padded to 4000.
- no prefix in the group (n_b = s_b) and no sliding window: right-padding with SDPA's top-left causal mask is exact
  for every real query (query i < n_b sees keys 0..i, all real), so no mask is built and the fused causal kernels run.
  Otherwise a bool mask [B, 1, Lq, Lk] (key j <= the query's position, inside the window) is built once per step and
  window, shared by all layers; padded query rows take the last real position so no row is empty (they are dropped).
- a group whose requests are consecutive, in order, with equal lengths (the common all-equal prefill batch) is a
  view of q, k and v: no gather, and the output needs no scatter when it is the only group.
All index tensors of a step travel to the device in one copy.

On CUDA the step needs none of this: `ExtendPlan.build(..., kernel=True)` holds only the seqs table of
kernels/extend_attention.py, whose one launch walks the packed requests as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moeserve.kernels.extend_attention import extend_seqs

PAD_FACTOR = 2.0  # a group may compute at most this many times its real query-key pairs...
SMALL_AREA = 1 << 20  # ...or any number while its padded area (pairs per head) is below this


@dataclass
class ExtendGroup:
    """One padded batch of requests. Index tensors are on the step's device; None where the group is dense."""

    batch: int
    lq: int
    lk: int
    causal: bool  # no mask: every request has n_b == s_b (and no sliding window applies)
    q_rows: tuple[int, int] | None = None  # dense: q rows [start, stop) and k/v rows [start, stop)
    kv_rows: tuple[int, int] | None = None
    q_index: torch.Tensor | None = None  # [batch * lq] row of q for each padded query (0 for padding)
    kv_index: torch.Tensor | None = None  # [batch * lk] row of k/v for each padded key (0 for padding)
    out_src: torch.Tensor | None = None  # [sum n_b] padded rows that are real queries
    out_dst: torch.Tensor | None = None  # [sum n_b] their rows in the output
    q_pos: torch.Tensor | None = None  # [batch, lq] each padded query's position (masked groups only)
    masks: dict = field(default_factory=dict)  # window (or None) -> [batch or 1, lq, lk] bool; "bias" -> bias();
    # "last_keys" -> last_keys()
    device: torch.device | str = "cpu"

    def mask(self, window: int | None) -> torch.Tensor | None:
        """The attention mask for this window (None: plain causal suffices)."""
        if self.causal and window is None:
            return None
        return self._key_mask(window)[:, None]

    def bias(self) -> torch.Tensor:
        """[batch or 1, lq, lk] float32 additive mask, 0 where the query sees the key and -inf elsewhere, built
        for causal groups too (the absorbed extend, layers/attention/latent_extend.py, broadcasts it over heads)."""
        if "bias" not in self.masks:
            self.masks["bias"] = torch.zeros(self._key_mask(None).shape, device=self.device).masked_fill_(
                ~self._key_mask(None), float("-inf"))
        return self.masks["bias"]

    def last_keys(self) -> list[int]:
        """[lq] host ints: the position of padded query row t in the request where it is furthest, the last key
        any request's row t sees (the absorbed extend reads no key past a block's last; memoized for the step)."""
        if "last_keys" not in self.masks:
            pos = self.q_pos.amax(dim=0) if self.q_pos is not None else torch.arange(self.lq)
            self.masks["last_keys"] = pos.tolist()
        return self.masks["last_keys"]

    def _key_mask(self, window: int | None) -> torch.Tensor:
        """[batch or 1, lq, lk] bool: key j <= the query's position (inside the window)."""
        if window not in self.masks:
            k_pos = torch.arange(self.lk, device=self.device)[None, None, :]
            if self.q_pos is None:  # dense (n_b = s_b for all): one mask for the whole batch
                q_pos = torch.arange(self.lq, device=self.device)[None, :, None]
            else:
                q_pos = self.q_pos[:, :, None]
            m = k_pos <= q_pos
            if window is not None:
                m &= k_pos > q_pos - window
            self.masks[window] = m
        return self.masks[window]


@dataclass
class ExtendPlan:
    """The groups of one extend step (see the module doc)."""

    num_tokens: int
    groups: list[ExtendGroup]
    seqs_host: torch.Tensor | None = None  # kernel plans: [B, 4] int32 (kernels/extend_attention.py), no groups
    max_extend: int = 0
    device: torch.device | str = "cpu"
    _seqs: torch.Tensor | None = None

    @property
    def seqs(self) -> torch.Tensor | None:
        """The kernel's seqs table on the step's device, copied there by the first layer that reads it (not when
        the plan is built: a piecewise CUDA graph's capture builds it inside the graph, where a copy from the host
        is not allowed, and runs attention between the graph's pieces)."""
        if self._seqs is None and self.seqs_host is not None:
            self._seqs = self.seqs_host.to(self.device, non_blocking=True)
        return self._seqs

    @classmethod
    def build(cls, extend_lens: list[int], seq_lens: list[int], device: torch.device | str,
              kernel: bool = False) -> ExtendPlan:
        """kernel: for the Triton kernel (the seqs table only); else the padded groups."""
        if kernel:
            return cls(num_tokens=sum(extend_lens), groups=[], seqs_host=extend_seqs(extend_lens, seq_lens, "cpu"),
                       max_extend=max(extend_lens, default=0), device=device)
        n = torch.tensor(extend_lens, dtype=torch.int64)
        s = torch.tensor(seq_lens, dtype=torch.int64)
        q_start = torch.cumsum(n, 0) - n
        kv_start = torch.cumsum(s, 0) - s
        live = [b for b in range(len(extend_lens)) if extend_lens[b] > 0]
        live.sort(key=lambda b: -seq_lens[b])  # stable: equal lengths keep their order (dense groups)
        groups, host = [], []
        for members in _cut(live, extend_lens, seq_lens):
            groups.append(_group(members, n, s, q_start, kv_start, host))
        for g in groups:
            g.device = device
        _to_device(groups, host, device)
        return cls(num_tokens=int(n.sum()), groups=groups)


def _cut(order: list[int], extend_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Consecutive runs of `order` (sorted by seq_len, longest first) within the padding budget."""
    runs: list[list[int]] = []
    lq = lk = real = 0
    for b in order:
        nq, nk = max(lq, extend_lens[b]), max(lk, seq_lens[b])
        area = (len(runs[-1]) + 1) * nq * nk if runs else 0
        new_real = real + extend_lens[b] * seq_lens[b]
        if runs and (area <= PAD_FACTOR * new_real or area <= SMALL_AREA):
            runs[-1].append(b)
            lq, lk, real = nq, nk, new_real
        else:
            runs.append([b])
            lq, lk, real = extend_lens[b], seq_lens[b], extend_lens[b] * seq_lens[b]
    return runs


def _group(members: list[int], n: torch.Tensor, s: torch.Tensor, q_start: torch.Tensor, kv_start: torch.Tensor,
           host: list) -> ExtendGroup:
    idx = torch.tensor(members)
    gn, gs = n[idx], s[idx]
    B, lq, lk = len(members), int(gn.max()), int(gs.max())
    causal = bool((gn == gs).all())
    dense = bool((gn == lq).all() and (gs == lk).all()) and members == list(range(members[0], members[0] + B))
    if dense and causal:  # a view of q, k, v; masked dense groups still need q_pos below
        q0, k0 = int(q_start[members[0]]), int(kv_start[members[0]])
        return ExtendGroup(B, lq, lk, True, q_rows=(q0, q0 + B * lq), kv_rows=(k0, k0 + B * lk))
    i = torch.arange(lq)[None, :]
    j = torch.arange(lk)[None, :]
    q_real = i < gn[:, None]  # [B, lq]
    q_index = torch.where(q_real, q_start[idx, None] + i, 0)
    kv_index = torch.where(j < gs[:, None], kv_start[idx, None] + j, 0)
    q_pos = (gs - gn)[:, None] + torch.minimum(i, gn[:, None] - 1)
    out_src = q_real.reshape(-1).nonzero()[:, 0]
    out_dst = q_index.reshape(-1)[out_src]
    group = ExtendGroup(B, lq, lk, causal)
    host.append((group, (q_index.reshape(-1), kv_index.reshape(-1), out_src, out_dst, q_pos.reshape(-1))))
    return group


def _to_device(groups: list[ExtendGroup], host: list, device: torch.device | str) -> None:
    """One host-to-device copy for every index tensor of the step, then views of it."""
    if not host:
        return
    flat = torch.cat([t for _, ts in host for t in ts]).to(device)
    at = 0
    for group, ts in host:
        views = []
        for t in ts:
            views.append(flat[at:at + t.numel()])
            at += t.numel()
        group.q_index, group.kv_index, group.out_src, group.out_dst, q_pos = views
        group.q_pos = q_pos.view(group.batch, group.lq)
