"""--watchdog-timeout: a rank whose step runs too long says where it is stuck and exits, as SGLang's watchdog.

A step that never ends (a collective whose peer died or hangs, a kernel that does not return) would otherwise hold
its requests forever. The rank exits instead; the server's RankClient names the dead rank in every error and the
server stops, for a supervisor to restart it.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)


def exit_rank(elapsed_s: float, timeout_s: float) -> None:
    """The default action: log, dump every thread's stack to stderr, exit with code 1 (no cleanup: it is stuck)."""
    logger.error("watchdog: a step has run %.1f s, over --watchdog-timeout %g s; exiting this rank. Its threads:",
                 elapsed_s, timeout_s)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(1)


class StepWatchdog:
    """A daemon thread that watches the step in flight; `with watchdog.step():` around each step."""

    def __init__(self, timeout_s: float, on_timeout: Callable[[float, float], None] = exit_rank):
        self.timeout_s = timeout_s
        self.on_timeout = on_timeout
        self._started: float | None = None  # monotonic start of the step in flight
        self._poll_s = max(0.01, min(1.0, timeout_s / 4))
        threading.Thread(target=self._watch, name="step-watchdog", daemon=True).start()

    @contextmanager
    def step(self) -> Iterator[None]:
        self._started = time.monotonic()
        try:
            yield
        finally:
            self._started = None

    def _watch(self) -> None:
        while True:
            time.sleep(self._poll_s)
            started = self._started
            if started is not None and (elapsed := time.monotonic() - started) > self.timeout_s:
                self.on_timeout(elapsed, self.timeout_s)
                return
