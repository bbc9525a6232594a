"""Background threads run torch single-threaded and leave the thread that started them its own count, even one that
had not run a parallel op yet (moeserve/core/background_thread.py). In a fresh interpreter: a thread's count is
fixed at its first use."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import torch
from moeserve.core.background_thread import background_thread
seen = []
t = background_thread(lambda: (torch.ones(4).exp(), seen.append(torch.get_num_threads())), "bg")
t.start(); t.join()
print(seen[0], torch.get_num_threads())
"""


def test_background_thread_single_threaded_and_caller_kept():
    default = int(subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                                 capture_output=True, text=True, check=True, timeout=120).stdout)
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True,
                         timeout=120).stdout.split()
    assert out == ["1", str(default)]
