"""Copies between KV pages in GPU memory and host bytes for a transport that sends host memory (the zmq backend),
without waiting on the model.

A plain `.cpu()` or `copy_` from pageable memory runs on the thread's current stream (the default one), so it
waits for every kernel queued there: a transfer thread's copy waited for the forward the scheduler had just
launched, and the H200 moved 0.04 GB/s between two processes. `HostStaging` belongs to one thread: it copies
through a pinned host buffer (grown as needed, reused) on a side stream of its own and waits for that stream only.
The caller makes sure the pages' contents are complete first (prefill synchronizes the model's stream before it
hands pages to a transfer thread; decode reads the pages only after the writer's acknowledgement).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class HostStaging:
    """A pinned buffer and a CUDA stream for one thread's copies on `device`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.buf = torch.empty(0, dtype=torch.uint8, pin_memory=True)

    def _reserve(self, nbytes: int) -> torch.Tensor:
        if self.buf.numel() < nbytes:
            self.buf = torch.empty(max(nbytes, 2 * self.buf.numel()), dtype=torch.uint8, pin_memory=True)
        return self.buf

    def to_host(self, parts: Sequence[torch.Tensor]) -> list[np.ndarray]:
        """uint8 GPU tensors -> numpy views of their bytes in the pinned buffer (valid until the next call)."""
        buf = self._reserve(sum(p.numel() for p in parts))
        out, off = [], 0
        with torch.cuda.stream(self.stream):
            for p in parts:
                n = p.numel()
                buf[off : off + n].copy_(p, non_blocking=True)
                out.append(off)
                off += n
        self.stream.synchronize()
        host = buf.numpy()
        return [host[o : o + p.numel()] for o, p in zip(out, parts, strict=True)]

    def to_device(self, pairs: Sequence[tuple[torch.Tensor, np.ndarray]]) -> None:
        """Copy each host byte array into its uint8 GPU tensor (same sizes); returns once the bytes are there."""
        buf = self._reserve(sum(src.size for _, src in pairs))
        host = buf.numpy()
        off = 0
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                n = src.size
                host[off : off + n] = src  # pageable -> pinned on the host, then one DMA per range
                dst.copy_(buf[off : off + n], non_blocking=True)
                off += n
        self.stream.synchronize()
