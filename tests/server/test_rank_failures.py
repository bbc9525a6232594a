"""Which rank the server blames when the engine dies: the one killed by a signal or gone without a word, not the
survivors that then lose their connection to it."""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.rank.io_struct import WorkerError
from moeserve.server.launch import describe_exit
from moeserve.server.rank_client import RankClient

RESET = "RuntimeError: [gloo] Read error: Connection reset by peer"


@dataclass
class _Proc:
    pid: int
    exitcode: int | None


def _reason(exitcodes: list[int | None], errors: list[WorkerError]) -> str:
    client = RankClient.__new__(RankClient)  # only what _failure_reason reads
    client.procs = [_Proc(100 + r, code) for r, code in enumerate(exitcodes)]
    client.local_ranks = list(range(len(exitcodes)))
    client._worker_errors = errors
    return client._failure_reason()


def test_the_killed_rank_is_blamed_not_the_survivor_that_reported():
    reason = _reason([1, -9], [WorkerError(0, RESET)])
    assert reason.startswith("rank 1 (pid 101) was killed by signal 9 (SIGKILL); then rank 0 failed: RuntimeError")


def test_a_rank_gone_without_a_word_is_blamed():
    assert _reason([None, 1], [WorkerError(0, RESET)]).startswith("rank 1 (pid 101) exited with code 1")


def test_a_rank_that_reported_its_own_failure_is_blamed():
    assert _reason([1, None], [WorkerError(0, "torch.OutOfMemoryError: CUDA out of memory")]) == (
        "rank 0 failed: torch.OutOfMemoryError: CUDA out of memory")


def test_describe_exit():
    assert describe_exit(-15) == "was killed by signal 15 (SIGTERM)"
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(None) == "is still running"
