"""Torch in a rank's background threads (the host tier's copies and page writes, PD transfers, EPLB's phase 2).

Such a thread runs its torch ops with one intra-op thread: a parallel region started from a thread other than the
scheduler's gets an OpenMP thread team of its own, and a second team beside the scheduler thread's slowed every CPU
forward after it, whether the background work still ran or not: on 2 cores the forward of 112 tokens over 512
cached took 29-32 ms with a host KV tier against 17-18 ms without, and 17-23 ms once its copy thread ran
single-threaded (benchmark/experiments/hicache_phases.py; the log of 2026-12-07).

torch keeps the setting per thread, but a thread takes its first value from the last one any thread set: so the
thread that starts a background thread fixes its own first (`keep_caller_threads`), or a scheduler thread that
had not run a parallel op yet would take the background thread's 1.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


def keep_caller_threads() -> None:
    """Fix the calling thread's intra-op thread count now (before it starts a background thread)."""
    torch.get_num_threads()


def single_threaded_torch() -> None:
    """First thing in a background thread that runs torch ops (a thread pool's initializer)."""
    torch.set_num_threads(1)


def background_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread (not started) that runs target with single-threaded torch; the caller's count is kept."""
    keep_caller_threads()

    def run() -> None:
        single_threaded_torch()
        target()

    return threading.Thread(target=run, name=name, daemon=True)
