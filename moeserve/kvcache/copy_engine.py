"""The host tier's copy engine: device -> host backups run off the scheduler's thread.

backup queues a copy and returns a CopyHandle at once. On CPU a worker thread gathers the device rows
(index_select) and scatters them into the host buffers. On CUDA the gather runs on a side stream that first
waits for an event recorded on the compute stream, so it reads the rows written by every step launched before;
the rows go non_blocking into pinned staging buffers, an event marks the end, and the worker thread waits for
that event and scatters the staging rows into the host buffers. The CUDA path ran on one H100 (2026-12-07,
tests/kvcache/test_copy_engine.py).

A handle is done once the bytes are in the host buffers and its `then` ran (the storage write). Until then the
caller must neither free the device slots (the forward would rewrite them) nor read, free or rewrite the host
slots. One worker: copies complete in the order they were queued. bytes_to_host is counted when a copy completes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from moeserve.core.background_thread import background_thread
from moeserve.kvcache.host_pool import HostKVPool

logger = logging.getLogger(__name__)

COPY_TIMEOUT_S = 60.0  # a copy of a few MB not done by then is a bug: wait raises instead of hanging the scheduler


class CopyHandle:
    """One queued backup: done() polls, wait() blocks until it completed (the synchronous path)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None  # set by the worker when the copy failed (the host copy is junk)

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float = COPY_TIMEOUT_S) -> None:
        """Block until the copy completed; TimeoutError after timeout_s."""
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"a host-tier KV copy did not complete in {timeout_s:.0f} s")


@dataclass
class _Backup:
    device_slots: np.ndarray  # [n] int64
    host_slots: np.ndarray  # [n] int64
    staged: tuple[list[torch.Tensor], torch.cuda.Event] | None  # CUDA: pinned rows per buffer, the copy's end
    then: Callable[[], None] | None
    handle: CopyHandle


class CopyEngine:
    """Backups of device slots into a HostKVPool, run by a worker thread (and a side stream on CUDA)."""

    def __init__(self, host: HostKVPool):
        self.host = host
        device = host.device_buffers[0].device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._queue: queue.Queue[_Backup | None] = queue.Queue()
        self._in_flight: deque[CopyHandle] = deque()  # scheduler thread only
        self._worker = background_thread(self._run, "kv-host-copier")
        self._worker.start()

    def backup(self, device_slots: np.ndarray, host_slots: np.ndarray,
               then: Callable[[], None] | None = None) -> CopyHandle:
        """Queue a copy of device slots [n] to host slots [n]; `then` runs in the worker after it, before the
        handle is done (the host slots are still the caller's to protect)."""
        assert len(device_slots) == len(host_slots)
        while self._in_flight and self._in_flight[0].done():
            self._in_flight.popleft()
        staged = self._gather_cuda(device_slots) if self._stream is not None else None
        handle = CopyHandle()
        self._in_flight.append(handle)
        self._queue.put(_Backup(device_slots, host_slots, staged, then, handle))
        return handle

    def wait_all(self, timeout_s: float = COPY_TIMEOUT_S) -> None:
        """Block until every queued copy completed (reset, close)."""
        deadline = time.monotonic() + timeout_s
        while self._in_flight:
            self._in_flight[0].wait(max(0.0, deadline - time.monotonic()))
            self._in_flight.popleft()

    def close(self) -> None:
        """Finish what is queued, then stop the worker."""
        self.wait_all()
        self._queue.put(None)
        self._worker.join(COPY_TIMEOUT_S)

    def _gather_cuda(self, device_slots: np.ndarray) -> tuple[list[torch.Tensor], torch.cuda.Event]:
        """Launch the gather of device slots into pinned rows on the side stream."""
        assert self._stream is not None
        device = self.host.device_buffers[0].device
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))  # the steps launched so far wrote these rows
        rows = [torch.empty((len(device_slots), *b.shape[1:]), dtype=b.dtype, pin_memory=True)
                for b in self.host.device_buffers]
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            idx = torch.from_numpy(device_slots).to(device)
            for dev, out in zip(self.host.device_buffers, rows, strict=True):
                out.copy_(dev.index_select(0, idx), non_blocking=True)
            end = torch.cuda.Event()
            end.record(self._stream)
        return rows, end

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self._copy(job)
                if job.then is not None:
                    job.then()
            except Exception as e:  # the cache drops this host copy (HiRadixCache._settle)
                logger.exception("host-tier KV copy failed")
                job.handle.error = e
            job.handle._done.set()

    def _copy(self, job: _Backup) -> None:
        host_idx = torch.from_numpy(job.host_slots)
        if job.staged is None:
            dev_idx = torch.from_numpy(job.device_slots)
            rows = [dev.index_select(0, dev_idx) for dev in self.host.device_buffers]
        else:
            rows, end = job.staged
            end.synchronize()
        for host, r in zip(self.host.buffers, rows, strict=True):
            host.index_copy_(0, host_idx, r)
        self.host.traffic.bytes_to_host += len(job.host_slots) * self.host.bytes_per_token
