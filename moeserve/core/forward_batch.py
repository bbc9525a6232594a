"""ForwardBatch: everything the model needs for one step on one rank, and nothing about requests.

The scheduler builds it (host side), the model runner moves it to the device, the model reads it. Attention
layers read the KV cache through `kv_pool` and the per-request token locations in `kv_indices`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import numpy as np
import torch

DECODE_LEN = 1  # tokens per request of a decode-like step (DECODE, MIXED's decodes); a verify step: k + 1


class ForwardMode(Enum):
    EXTEND = auto()  # prefill (possibly a chunk, possibly after a cached prefix)
    DECODE = auto()  # DECODE_LEN new tokens per request
    MIXED = auto()  # an extend whose last `num_decodes` requests are running decodes (--enable-mixed-chunk)
    IDLE = auto()  # this rank has no tokens but joins the MoE collectives

    @property
    def is_extend(self) -> bool:
        """Prefill tokens run this step (a MIXED step is an extend for dispatch, the header and CUDA graphs)."""
        return self is ForwardMode.EXTEND or self is ForwardMode.MIXED

    @property
    def is_mixed(self) -> bool:
        return self is ForwardMode.MIXED

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    @property
    def is_idle(self) -> bool:
        return self is ForwardMode.IDLE


DEVICE_FIELDS = ("input_ids", "positions", "seq_lens", "extend_lens", "prefix_lens", "out_cache_loc", "kv_indices",
                 "kv_indptr", "qo_indptr", "logits_indices", "decode_slots")
ALIGN = 16  # elements: each tensor of a packed copy starts 128 bytes in, as a kernel's own allocation would


def packed_copy(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Host tensors to the device in one copy per dtype: packed into one pinned buffer, copied without blocking,
    handed back as views of the device buffer in their shapes. A step's dozen small copies from pageable memory
    cost the host tens of microseconds each; one pinned copy costs one. (The pinned buffer is not reused before
    the copy ends: torch's host allocator waits for it.)"""
    out = {}
    for dtype in dict.fromkeys(t.dtype for t in tensors.values()):
        group = {name: t for name, t in tensors.items() if t.dtype == dtype}
        sizes = {name: -(-t.numel() // ALIGN) * ALIGN for name, t in group.items()}
        buf = torch.empty(sum(sizes.values()), dtype=dtype, pin_memory=device.type == "cuda")
        offsets, at = {}, 0
        for name, t in group.items():
            buf[at:at + t.numel()].copy_(t.reshape(-1))
            offsets[name], at = at, at + sizes[name]
        dev = buf.to(device, non_blocking=True)
        out.update({name: dev[offsets[name]:offsets[name] + t.numel()].view(t.shape) for name, t in group.items()})
    return out


def _on(t: torch.Tensor, device: torch.device) -> bool:
    """t is on `device` ('cuda' without an index: any GPU is)."""
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


@dataclass
class ForwardBatch:
    """One step's input on one rank. Shapes: T new tokens, B requests."""

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each new token in its sequence
    seq_lens: torch.Tensor  # [B] int64, sequence length after this step (prefix + new)
    extend_lens: torch.Tensor  # [B] int64, new tokens per request (DECODE_LEN each for DECODE)
    prefix_lens: torch.Tensor  # [B] int64, tokens already in the KV cache before this step
    out_cache_loc: torch.Tensor  # [T] int64, KV slots written by this step's tokens
    kv_indices: torch.Tensor  # [sum(seq_lens)] int64, KV slots of every request's whole sequence, concatenated
    kv_indptr: torch.Tensor  # [B + 1] int64, request b's slots are kv_indices[kv_indptr[b]:kv_indptr[b+1]]
    qo_indptr: torch.Tensor  # [B + 1] int64, request b's new tokens are rows qo_indptr[b]:qo_indptr[b+1]
    kv_pool: Any = None  # kvcache's KVPool (a floor above core: not imported here)
    # Host copies of the lengths (python ints) so attention can split without a device sync.
    seq_lens_cpu: list[int] = field(default_factory=list)
    extend_lens_cpu: list[int] = field(default_factory=list)
    prefix_lens_cpu: list[int] = field(default_factory=list)
    # Multi-rank lock-step header: tokens per DP rank this step (the same list on every rank).
    global_num_tokens: list[int] | None = None
    any_extend: bool = False  # some rank prefills this step: `auto` dispatch picks normal mode
    static_bs: int | None = None  # DECODE/IDLE: the padded size every DP group runs (rank/static_shape.py)
    # EXTEND/MIXED/IDLE: the padded token count every DP group runs (rank/static_extend.py)
    static_num_tokens: int | None = None
    # Which rows of the output need logits: last token of each request by default.
    logits_indices: torch.Tensor | None = None  # [B] int64 rows of the hidden states fed to the LM head
    return_all_logits: bool = False  # tests and prompt logprobs: logits for every new token
    # DECODE only: every request's cache slots as a padded block [B, L >= max seq_len]; entries past a
    # request's seq_len are any valid slot (attention masks them by seq_lens). Static shapes for CUDA graphs.
    decode_slots: torch.Tensor | None = None
    # MIXED only: the last num_decodes requests (DECODE_LEN new tokens each) are decodes; attention runs them through the
    # decode kernel (decode_slots then holds their rows only, [num_decodes, L]) and the rest as an extend.
    num_decodes: int = 0

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> ForwardBatch:
        """Move the tensors to the device (non-blocking); host lists stay. To a GPU they travel in one copy."""
        device = torch.device(device)
        moved = {name: getattr(self, name) for name in DEVICE_FIELDS}
        elsewhere = {name: t for name, t in moved.items() if t is not None and not _on(t, device)}
        packed = {name: t for name, t in elsewhere.items() if t.device.type == "cpu"} if device.type == "cuda" else {}
        if len(packed) < 2:  # (one tensor: a plain copy)
            packed = {}
        moved.update(packed_copy(packed, device) if packed else {})
        moved.update({name: t.to(device, non_blocking=True) for name, t in elsewhere.items() if name not in packed})
        return _replace(self, **moved)

    @staticmethod
    def build(
        mode: ForwardMode,
        input_ids: list[int],
        seq_lens: list[int],
        extend_lens: list[int],
        out_cache_loc: list[int] | torch.Tensor,
        kv_indices: list[int] | torch.Tensor,
        kv_pool: Any = None,
        return_all_logits: bool = False,
        num_decodes: int = 0,
    ) -> ForwardBatch:
        """Build the batch from host-side lists (the scheduler's view). Positions continue each prefix.
        MIXED: the last num_decodes requests must have extend_lens DECODE_LEN."""
        assert mode.is_mixed or num_decodes == 0
        assert num_decodes == 0 or all(e == DECODE_LEN for e in extend_lens[len(extend_lens) - num_decodes:])
        # built in numpy and handed to torch without copies: a decode step's dozen small tensors made by torch ops
        # took ~100 us at batch 1 on the CPU, about 4% of the step
        i64 = np.int64
        ext = np.asarray(extend_lens, dtype=i64)
        seq = np.asarray(seq_lens, dtype=i64)
        pre = seq - ext
        qo_indptr = np.zeros(len(seq) + 1, dtype=i64)
        np.cumsum(ext, out=qo_indptr[1:])
        # token i of request b sits at prefix_b + (i - qo_start_b): one vector op, not a loop over the tokens
        positions = pre.copy() if mode.is_decode and DECODE_LEN == 1 else (np.arange(qo_indptr[-1], dtype=i64)
                                                                           + np.repeat(pre - qo_indptr[:-1], ext))
        kv_indptr = np.zeros(len(seq) + 1, dtype=i64)
        np.cumsum(seq, out=kv_indptr[1:])
        qo = torch.from_numpy(qo_indptr)
        return ForwardBatch(
            mode=mode,
            input_ids=torch.from_numpy(np.fromiter(input_ids, dtype=i64, count=len(input_ids))),  # 3x tensor()
            positions=torch.from_numpy(positions),
            seq_lens=torch.from_numpy(seq),
            extend_lens=torch.from_numpy(ext),
            prefix_lens=torch.from_numpy(pre),
            out_cache_loc=_int64_tensor(out_cache_loc),
            kv_indices=_int64_tensor(kv_indices),
            kv_indptr=torch.from_numpy(kv_indptr),
            qo_indptr=qo,
            kv_pool=kv_pool,
            seq_lens_cpu=list(seq_lens),
            extend_lens_cpu=list(extend_lens),
            prefix_lens_cpu=pre.tolist(),
            logits_indices=None if return_all_logits else qo[1:] - 1,
            return_all_logits=return_all_logits,
            any_extend=mode.is_extend,
            num_decodes=num_decodes,
        )

    def mixed_parts(self) -> tuple[ForwardBatch, ForwardBatch]:
        """MIXED: (the extend requests as an EXTEND batch, the decodes as a DECODE batch), views of this batch's
        tensors (no device sync: the cut points come from the host lengths). Attention runs each part its way."""
        assert self.mode.is_mixed
        nd = self.num_decodes
        ne = self.batch_size - nd
        t = sum(self.extend_lens_cpu[:ne])  # extend tokens come first
        s = sum(self.seq_lens_cpu[:ne])  # and so do their KV slots
        ext = ForwardBatch(
            mode=ForwardMode.EXTEND, input_ids=self.input_ids[:t], positions=self.positions[:t],
            seq_lens=self.seq_lens[:ne], extend_lens=self.extend_lens[:ne], prefix_lens=self.prefix_lens[:ne],
            out_cache_loc=self.out_cache_loc[:t], kv_indices=self.kv_indices[:s], kv_indptr=self.kv_indptr[:ne + 1],
            qo_indptr=self.qo_indptr[:ne + 1], kv_pool=self.kv_pool, seq_lens_cpu=self.seq_lens_cpu[:ne],
            extend_lens_cpu=self.extend_lens_cpu[:ne], prefix_lens_cpu=self.prefix_lens_cpu[:ne],
            global_num_tokens=self.global_num_tokens, any_extend=self.any_extend)
        dec = ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[t:], positions=self.positions[t:],
            seq_lens=self.seq_lens[ne:], extend_lens=self.extend_lens[ne:], prefix_lens=self.prefix_lens[ne:],
            out_cache_loc=self.out_cache_loc[t:], kv_indices=self.kv_indices[s:],
            kv_indptr=self.kv_indptr[ne:] - self.kv_indptr[ne], qo_indptr=self.qo_indptr[ne:] - self.qo_indptr[ne],
            kv_pool=self.kv_pool, seq_lens_cpu=self.seq_lens_cpu[ne:], extend_lens_cpu=self.extend_lens_cpu[ne:],
            prefix_lens_cpu=self.prefix_lens_cpu[ne:], global_num_tokens=self.global_num_tokens,
            any_extend=self.any_extend, decode_slots=self.decode_slots)
        return ext, dec

    @staticmethod
    def idle(kv_pool: Any = None, device: torch.device | str = "cpu") -> ForwardBatch:
        """A batch with no tokens: the rank only joins the collectives. Made on `device` (no copy: capturable)."""
        e = torch.zeros(0, dtype=torch.int64, device=device)
        zero = torch.zeros(1, dtype=torch.int64, device=device)
        return ForwardBatch(
            mode=ForwardMode.IDLE, input_ids=e, positions=e, seq_lens=e, extend_lens=e, prefix_lens=e,
            out_cache_loc=e, kv_indices=e, kv_indptr=zero, qo_indptr=zero, kv_pool=kv_pool, logits_indices=e,
        )


def _int64_tensor(x: list[int] | np.ndarray | torch.Tensor) -> torch.Tensor:
    """x as an int64 tensor, sharing an int64 array's or tensor's memory (as torch.as_tensor does)."""
    if isinstance(x, torch.Tensor):
        return x.to(torch.int64)
    return torch.from_numpy(np.asarray(x, dtype=np.int64))


def _replace(batch: ForwardBatch, **changes) -> ForwardBatch:
    import dataclasses

    return dataclasses.replace(batch, **changes)
