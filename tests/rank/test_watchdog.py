"""--watchdog-timeout: a step that runs too long makes its rank log where it is stuck and exit (as SGLang's)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from moeserve.rank.watchdog import StepWatchdog


def test_only_a_step_over_the_timeout_fires():
    fired: list[tuple[float, float]] = []
    dog = StepWatchdog(0.3, on_timeout=lambda elapsed, timeout: fired.append((elapsed, timeout)))
    rng = random.Random(49)
    for _ in range(5):  # short steps, and idle time between them, never fire
        with dog.step():
            time.sleep(rng.uniform(0.0, 0.1))
        time.sleep(rng.uniform(0.0, 0.5))
    assert fired == []
    with dog.step():
        deadline = time.monotonic() + 5
        while not fired and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(fired) == 1 and fired[0][0] > 0.3 and fired[0][1] == 0.3


def test_the_default_action_dumps_the_stacks_and_exits():
    code = ("import logging, time; logging.basicConfig()\n"
            "from moeserve.rank.watchdog import StepWatchdog\n"
            "dog = StepWatchdog(0.2)\n"
            "def stuck_in_a_collective():\n"
            "    time.sleep(30)\n"
            "with dog.step():\n"
            "    stuck_in_a_collective()\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 1 and time.monotonic() - start < 15
    assert "over --watchdog-timeout 0.2 s; exiting this rank" in proc.stderr
    assert "stuck_in_a_collective" in proc.stderr  # where the main thread waits


@pytest.mark.slow
def test_a_rank_waiting_on_a_stopped_peer_exits_and_the_server_names_it(tiny_checkpoint):
    from moeserve.server.engine import Engine

    eng = Engine(model_path=tiny_checkpoint("v3_groups"), skip_tokenizer_init=True, dtype="float32", tp_size=2,
                 dp_size=2, enable_dp_attention=True, moe_a2a_backend="all2all", watchdog_timeout=2.0,
                 log_level="error")
    procs = eng.client.ranks.procs
    result: list = []
    try:
        os.kill(procs[1].pid, signal.SIGSTOP)  # rank 1 hangs: rank 0's next step waits on it in the header
        worker = threading.Thread(target=lambda: result.append(_generate(eng)), daemon=True)
        worker.start()
        worker.join(timeout=60)
        assert not worker.is_alive(), "the request never ended"
        assert procs[0].exitcode == 1
        assert "rank 0" in result[0] and "exited with code 1" in result[0], result
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
        eng.shutdown()


def _generate(eng) -> str:
    try:
        return repr(eng.generate(input_ids=[5, 6, 7, 8], sampling_params=dict(max_new_tokens=4, temperature=0.0)))
    except Exception as e:  # the engine died: the error names the rank
        return str(e)
