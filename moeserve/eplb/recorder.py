"""The expert-distribution recorder (--expert-distribution-recorder-mode): how many tokens each MoE layer routed to
each logical expert, for `moeserve eplb`, --init-expert-location and the online rebalancer.

Every MoE layer reports its chosen logical experts (MoE.route, before the logical-to-physical map); the recorder
adds them into one int64 tensor [MoE layers, experts] on the device: no host sync, and the add is captured into
CUDA graphs (the tensor exists before any capture and is never replaced). So the counter always runs, and
recording is a window over it: start remembers where it was, stop freezes the window, dump reads it. A rank counts
the tokens it routes; the server sums the ranks (attention-TP ranks that route the same tokens count them once:
only the group's first rank reports them).

Modes, each a superset of the one before:
- stat:      the window's counts, `logical_count` [1, layers, experts];
- per_pass:  also each forward pass's counts, `logical_count` [passes, layers, experts] with `forward_pass_id`
             [passes]: a ring of the last `buffer_size` passes (every rank counts the same passes: they step in
             lock-step), what `moeserve eplb analyze` plots over time;
- per_token: also every routed token's experts, `topk_ids` [tokens, layers, k] with `forward_pass_id` [tokens]:
             a ring of the last `buffer_size` tokens.
Only real rows count: the model marks them before its layers run (`on_pass_begin`, from out_cache_loc != 0:
the padding rows of CUDA graphs and piecewise graphs write to the scratch KV slot 0, which no request owns), and the
layers' adds are weighted by that mask on the device (no host sync, captured like the add). Start-up warm-ups and
captures run inside `not_counting()`, which puts the counts back as they were.
The model runner calls `on_pass_end(rows)` after every forward pass (outside CUDA graphs), with the rows this
rank's MoE layers routed. The dump (TokenizerManager.dump_expert_distribution) is a .pt file written under
`expert_distribution_dir()` unless the offline Engine gives a path; its `logical_count` is what `moeserve eplb` and
ExpertLocation.load read (SGLang's stat dump has the same key).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from moeserve.paths import cache_root

RECORDER_MODES = ("stat", "per_pass", "per_token")  # --expert-distribution-recorder-mode


def expert_distribution_dir() -> Path:
    """Where the server writes dumps: $MOESERVE_CACHE/expert_distribution (see moeserve/paths.py)."""
    return cache_root() / "expert_distribution"


class ExpertDistributionRecorder:
    """Counts of every (MoE layer, logical expert) on one rank since start-up, per pass or per token as the mode
    asks, and the recording window."""

    def __init__(self, moe_layers: Sequence[int], num_experts: int, device: torch.device | str, mode: str = "stat",
                 buffer_size: int = 1000, top_k: int = 1, max_rows_per_pass: int = 1):
        """buffer_size: passes kept (per_pass) or tokens kept (per_token). top_k and max_rows_per_pass (the most
        tokens one forward pass routes on this rank) size per_token's buffers."""
        if buffer_size < 1:
            raise ValueError(f"--expert-distribution-recorder-buffer-size must be >= 1, got {buffer_size}")
        self.mode, self.buffer_size = mode, buffer_size
        self.layer_index = {layer: i for i, layer in enumerate(moe_layers)}
        num_layers = len(moe_layers)
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self._valid: torch.Tensor | None = None  # [T] int64 1 for a real row of the pass in progress, 0 for padding
        self.pass_id = 0  # forward passes ended so far (the same on every rank)
        self._start: tuple[torch.Tensor, int] | None = None  # (counts, pass id) when recording started
        self._window: tuple[torch.Tensor, int, int] | None = None  # the last stopped window: counts, passes
        if mode == "per_pass":
            self._pass_counts = torch.zeros(buffer_size, num_layers, num_experts, dtype=torch.int64, device=device)
            self._pass_ids = [-1] * buffer_size  # the pass each ring slot holds
            self._last = self.counts.clone()  # counts at the end of the previous pass
        if mode == "per_token":
            self._step_ids = torch.zeros(max_rows_per_pass, num_layers, top_k, dtype=torch.int32, device=device)
            self._token_ids = torch.zeros(buffer_size, num_layers, top_k, dtype=torch.int32, device=device)
            self._token_pass = torch.full((buffer_size,), -1, dtype=torch.int64, device=device)
            self._token_seq = torch.zeros(buffer_size, dtype=torch.int64, device=device)  # arrival order
            self._tokens_seen = 0

    # ------------------------------------------------------------------ the hot path
    def on_pass_begin(self, valid_rows: torch.Tensor | None) -> None:
        """valid_rows [T] bool on the device: which of the rows this rank's MoE layers route in the coming forward
        are real tokens (None: all of them). Inside the forward, possibly a CUDA graph."""
        self._valid = None if valid_rows is None else valid_rows.to(torch.int64)

    def on_select_experts(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """topk_ids [T, k] logical ids of one MoE layer (inside the forward, possibly a CUDA graph)."""
        i = self.layer_index.get(layer_id)
        if i is None or topk_ids.device != self.counts.device:  # another model's layer (tests build several)
            return
        ids = topk_ids.reshape(-1)
        valid = self._valid
        if valid is not None and valid.shape[0] == topk_ids.shape[0]:  # NOTE: a two-batch-overlap micro-batch
            weights = valid[:, None].expand(topk_ids.shape).reshape(-1)  # routes part of them; eager: no padding
        else:
            weights = torch.ones_like(ids)
        self.counts[i].scatter_add_(0, ids, weights)
        if self.mode == "per_token" and topk_ids.shape[0]:
            self._step_ids[: topk_ids.shape[0], i].copy_(topk_ids)

    def on_pass_end(self, rows: int) -> None:
        """After a forward pass (outside CUDA graphs): `rows` tokens went through this rank's MoE layers."""
        if self.mode == "per_pass":
            slot = self.pass_id % self.buffer_size
            torch.sub(self.counts, self._last, out=self._pass_counts[slot])
            self._last.copy_(self.counts)
            self._pass_ids[slot] = self.pass_id
        elif self.mode == "per_token" and rows:
            for dst, src, n in _ring_spans(self._tokens_seen, rows, self.buffer_size):
                self._token_ids[dst:dst + n].copy_(self._step_ids[src:src + n])
                self._token_pass[dst:dst + n] = self.pass_id
                first = self._tokens_seen + src
                torch.arange(first, first + n, out=self._token_seq[dst:dst + n])
            self._tokens_seen += rows
        self.pass_id += 1

    @contextmanager
    def not_counting(self) -> Iterator[None]:
        """Forward passes inside (start-up warm-ups, CUDA-graph captures) leave the counts as they were."""
        saved = self.counts.clone()
        try:
            yield
        finally:
            self.counts.copy_(saved)  # in place: captured graphs and the rebalancer hold this tensor
            self._valid = None

    # ------------------------------------------------------------------ the window
    def start(self) -> None:
        """Begin a new window (a window in progress is dropped)."""
        self._start, self._window = (self.counts.clone(), self.pass_id), None

    def stop(self) -> None:
        if self._start is not None:
            counts, first = self._start
            self._window, self._start = (self.counts - counts, first, self.pass_id), None

    def window(self) -> torch.Tensor:
        """[layers, experts] int64 on the CPU: the window in progress, else the last stopped one, else zeros."""
        return self._current()[0].cpu()

    def dump(self) -> dict[str, torch.Tensor]:
        """This rank's part of the dump, on the CPU: `logical_count` [1, layers, experts] (stat) or [passes, layers,
        experts] with `forward_pass_id` (per_pass); per_token adds `topk_ids` [tokens, layers, k] and their
        `forward_pass_id`. Only passes (tokens) of the window still in the ring."""
        counts, first, last = self._current()
        if self.mode == "per_pass":
            slots = [s for s, p in enumerate(self._pass_ids) if first <= p < last]
            slots.sort(key=lambda s: self._pass_ids[s])
            return {"logical_count": self._pass_counts[slots].cpu(),
                    "forward_pass_id": torch.tensor([self._pass_ids[s] for s in slots], dtype=torch.int64)}
        out = {"logical_count": counts.cpu()[None]}
        if self.mode == "per_token":
            passes = self._token_pass.cpu()
            keep = ((passes >= first) & (passes < last)).nonzero().squeeze(1)
            keep = keep[torch.argsort(self._token_seq.cpu()[keep])]
            out["topk_ids"] = self._token_ids.cpu()[keep].long()
            out["forward_pass_id"] = passes[keep]
        return out

    def _current(self) -> tuple[torch.Tensor, int, int]:
        """(counts, first pass, end pass) of the window in progress, else the last stopped one, else empty."""
        if self._start is not None:
            counts, first = self._start
            return self.counts - counts, first, self.pass_id
        if self._window is not None:
            return self._window
        return torch.zeros_like(self.counts), 0, 0


def _ring_spans(head: int, n: int, size: int) -> list[tuple[int, int, int]]:
    """(ring position, source row, count) spans that write n rows at `head` into a ring of `size` (the newest kept
    when n > size)."""
    skip = max(0, n - size)
    head, n = head + skip, n - skip
    spans, src = [], skip
    while n:
        dst = head % size
        count = min(n, size - dst)
        spans.append((dst, src, count))
        head, src, n = head + count, src + count, n - count
    return spans


def merge_dumps(parts: Sequence[dict[str, torch.Tensor]], mode: str) -> dict[str, torch.Tensor]:
    """The dump of the whole server from each DP group's part (attention-TP ranks already summed): counts add up
    (per pass, the groups hold the same passes: they step in lock-step); per_token records are concatenated."""
    out = {"logical_count": sum(p["logical_count"] for p in parts)}
    if mode == "per_pass":
        out["forward_pass_id"] = parts[0]["forward_pass_id"]
    if mode == "per_token":
        out["topk_ids"] = torch.cat([p["topk_ids"] for p in parts])
        out["forward_pass_id"] = torch.cat([p["forward_pass_id"] for p in parts])
    return out
