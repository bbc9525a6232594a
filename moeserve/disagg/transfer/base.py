"""The one interface every KV transfer backend implements: one-sided page writes into a peer's KV pool.

Both sides build a backend over their own KV pool's buffers (kvcache/kv_pool.py: one tensor per layer, or per layer
and K/V, each [num_slots, ...] with `page_size` consecutive rows per page, so a run of consecutive pages is one
contiguous byte range in every buffer). The decode side publishes `endpoint()` (through the control messages);
the prefill side calls `write(peer_endpoint, runs)` from a transfer thread. When `write` returns, every byte of
those pages is in the peer's buffers; otherwise it raises TransferError and nothing is promised about the
destination pages (the caller fails the request, and decode frees them only after this write has returned or
raised: no late write can land in pages another request owns).

The first token, its logprobs and `cached_tokens` travel in the control message that reports completion, not
through the backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


class TransferError(RuntimeError):
    """A write did not complete: the peer is unreachable, timed out, or the backend reported a failure."""


@dataclass(frozen=True)
class PageRun:
    """`num_pages` consecutive pages from `src_page` on this side to `dst_page` on the peer, in every buffer."""

    src_page: int
    dst_page: int
    num_pages: int


def merge_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[PageRun]:
    """Page pairs (src_pages[i] -> dst_pages[i]) as the fewest runs that are consecutive on both sides."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
    runs: list[PageRun] = []
    for s, d in zip(src_pages, dst_pages, strict=True):
        last = runs[-1] if runs else None
        if last is not None and s == last.src_page + last.num_pages and d == last.dst_page + last.num_pages:
            runs[-1] = PageRun(last.src_page, last.dst_page, last.num_pages + 1)
        else:
            runs.append(PageRun(s, d, 1))
    return runs


def page_bytes(buffer: torch.Tensor, page_size: int) -> int:
    """Bytes one page takes in a KV buffer of [num_slots, ...] rows."""
    return page_size * buffer[0].numel() * buffer.element_size()


class TransferBackend(ABC):
    """One side's KV buffers, registered with a transport so that a peer can be written to (or write here).

    buffers: the KV pool's buffers in a fixed order (both sides must list them the same way: layer by layer,
    K before V for GQA: `kvcache.kv_pool.kv_buffers`), contiguous, on CPU or CUDA. page_size: token rows per page (equal on
    both sides; the bootstrap refuses otherwise). The rank builds every backend the same way:
    `cls(buffers, page_size, host=<this rank's address for peers>, api_key=<--api-key or None>,
    ib_device=<--disaggregation-ib-device or None>)`; a backend that cannot use an option raises ValueError.
    """

    name: ClassVar[str]
    # open_window/close_window guard the pages: a write that comes after close_window is dropped
    refuses_late_writes: ClassVar[bool] = False

    def __init__(self, buffers: Sequence[torch.Tensor], page_size: int):
        for i, b in enumerate(buffers):
            if not b.is_contiguous():
                raise ValueError(f"KV buffer {i} is not contiguous")
        self.buffers = list(buffers)
        self.page_size = page_size
        self.page_bytes = [page_bytes(b, page_size) for b in self.buffers]

    @abstractmethod
    def endpoint(self) -> dict[str, Any]:
        """What a peer needs to write into this side's buffers (JSON-able: addresses, session name, page_bytes)."""

    @abstractmethod
    def write(self, peer: dict[str, Any], runs: Sequence[PageRun], timeout_s: float) -> int:
        """Copy `runs` of this side's pages into the peer's buffers (every buffer); returns the bytes moved.

        Blocks until the bytes are in the peer's memory; raises TransferError on any failure or after
        timeout_s. Thread-safe: several transfer threads may write at once.
        """

    def open_window(self, window: str, pages: Sequence[int]) -> None:
        """Decode side: allow writes tagged `window` (the peer dict's "window") into `pages` until close_window.

        A backend whose writes travel as messages (zmq) checks every write against its window, so that a write
        still in flight when the request was freed is dropped instead of landing in pages another request owns.
        One-sided backends (RDMA) rely on the writer's acknowledgement instead and need not do anything here.
        """
        return None

    def close_window(self, window: str) -> None:
        """Decode side: no write of `window` lands after this returns."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Release the transport (sockets, registered memory). Idempotent."""

    def check_peer(self, peer: dict[str, Any]) -> None:
        """Raise ValueError when the peer's buffers cannot take this side's pages (count or page sizes differ)."""
        theirs = list(peer.get("page_bytes", []))
        if theirs != self.page_bytes:
            raise ValueError(f"KV layout differs between prefill and decode: page bytes per buffer "
                             f"{self.page_bytes[:4]}... ({len(self.page_bytes)} buffers) here, "
                             f"{theirs[:4]}... ({len(theirs)} buffers) on the peer; "
                             f"both sides need the same model, --page-size, --dtype and attention TP "
                             f"layout")
