"""MooncakeBackend between two processes on 127.0.0.1 (TCP): random page runs written from this process into a
peer's KV-pool-shaped buffers land exactly there (every buffer, nothing else touched), also from two threads at
once; a stalled or dead peer is a TransferError, not a hang; mismatched layouts are refused at check_peer."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from moeserve.disagg.transfer.base import PageRun, TransferError, merge_runs
from tests.disagg.kv_peer import PAGE_SIZE, make_buffers

try:
    from moeserve.disagg.transfer.mooncake import BATCH_RANGES, MooncakeBackend
except ImportError as e:
    pytest.skip(f"Mooncake cannot load: {e}", allow_module_level=True)

pytestmark = pytest.mark.timeout(120)

NUM_PAGES = 2400  # a write of every page, shuffled, is ~9,600 address ranges: more than one engine call
REPO = Path(__file__).parents[2]


class Peer:
    """The decode side: a kv_peer process holding buffers made from `seed`."""

    def __init__(self, seed: int, num_pages: int = NUM_PAGES):
        self.seed, self.num_pages = seed, num_pages
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.disagg.kv_peer", "mooncake", str(seed),
                                      str(num_pages)], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        line = self.proc.stdout.readline()
        assert line, f"the peer exited with {self.proc.wait()}"
        self.endpoint = json.loads(line)

    def dump(self, path: Path) -> list[torch.Tensor]:
        self.proc.stdin.write(f"dump {path}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "dumped"
        return torch.load(path)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
            assert self.proc.wait(timeout=30) == 0


@pytest.fixture(scope="module")
def peer():
    p = Peer(seed=random.randrange(1 << 30))
    yield p
    p.stop()


@pytest.fixture
def doomed_peer():
    p = Peer(seed=random.randrange(1 << 30))
    yield p
    p.proc.kill()
    p.proc.wait()


def random_runs(rng: random.Random, num_pages: int, count: int) -> list[PageRun]:
    """`count` pages, distinct on each side: a stretch consecutive on both sides, then random pairs."""
    stretch = count // 2
    a, b = rng.randrange(num_pages - stretch), rng.randrange(num_pages - stretch)
    src = list(range(a, a + stretch)) + rng.sample([p for p in range(num_pages) if not a <= p < a + stretch],
                                                   count - stretch)
    dst = list(range(b, b + stretch)) + rng.sample([p for p in range(num_pages) if not b <= p < b + stretch],
                                                   count - stretch)
    return merge_runs(src, dst)


def expected(before: list[torch.Tensor], source: list[torch.Tensor], runs: list[PageRun]) -> list[torch.Tensor]:
    out = [b.clone() for b in before]
    for o, s in zip(out, source, strict=True):
        for r in runs:
            o[r.dst_page * PAGE_SIZE:(r.dst_page + r.num_pages) * PAGE_SIZE] = \
                s[r.src_page * PAGE_SIZE:(r.src_page + r.num_pages) * PAGE_SIZE]
    return out


def test_random_page_runs_land_exactly(peer, tmp_path):
    rng = random.Random()
    source = make_buffers(rng.randrange(1 << 30), NUM_PAGES)
    before = peer.dump(tmp_path / "before.pt")
    assert all(torch.equal(x, y) for x, y in zip(before, make_buffers(peer.seed, NUM_PAGES), strict=True))
    backend = MooncakeBackend(source, PAGE_SIZE, host="127.0.0.1")
    try:
        backend.check_peer(peer.endpoint)
        runs = random_runs(rng, NUM_PAGES, 24)
        assert any(r.num_pages > 1 for r in runs) and len(runs) > 1
        moved = backend.write(peer.endpoint, runs, timeout_s=30)
        assert moved == sum(r.num_pages for r in runs) * sum(backend.page_bytes)
        after = peer.dump(tmp_path / "a.pt")
        for got, want in zip(after, expected(before, source, runs), strict=True):
            assert torch.equal(got, want)

        # Every page, shuffled (thousands of one-page runs: more ranges than Mooncake's TCP queue holds by
        # default, and than one engine call takes), from changed source data: the engine reads at write time.
        for s in source:
            s.copy_(torch.randn(s.shape).to(s.dtype))
        perm = merge_runs(list(range(NUM_PAGES)), rng.sample(range(NUM_PAGES), NUM_PAGES))
        assert len(perm) * len(source) > BATCH_RANGES
        backend.write(peer.endpoint, perm, timeout_s=60)
        after2 = peer.dump(tmp_path / "b.pt")
        for got, want in zip(after2, expected(after, source, perm), strict=True):
            assert torch.equal(got, want)

        # Two threads writing disjoint destination pages at once, from other source data again.
        for s in source:
            s.copy_(torch.randn(s.shape).to(s.dtype))
        halves = [perm[k::2] for k in (0, 1)]
        errors = []
        threads = [threading.Thread(target=_write_or_record, args=(backend, peer.endpoint, h, errors))
                   for h in halves]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        after3 = peer.dump(tmp_path / "c.pt")
        for got, want in zip(after3, expected(after2, source, perm), strict=True):
            assert torch.equal(got, want)
    finally:
        backend.close()
        backend.close()  # idempotent


def _write_or_record(backend, peer, runs, errors) -> None:
    try:
        backend.write(peer, runs, timeout_s=60)
    except Exception as e:  # noqa: BLE001 - the test thread reports it
        errors.append(e)


def test_dead_peer_raises(doomed_peer):
    peer = doomed_peer
    backend = MooncakeBackend(make_buffers(1, NUM_PAGES), PAGE_SIZE, host="127.0.0.1")
    try:
        backend.write(peer.endpoint, [PageRun(0, 0, 2)], timeout_s=30)  # a live peer first: the session is open
        # A stalled peer (alive, never answering): the engine gives up after its timeout, the write raises.
        os.kill(peer.proc.pid, signal.SIGSTOP)
        while Path(f"/proc/{peer.proc.pid}/stat").read_text().split(")")[-1].split()[0] != "T":
            time.sleep(0.01)  # stopped: every thread of it, its receiving threads too
        with pytest.raises(TransferError, match="timed out"):
            backend.write(peer.endpoint, [PageRun(0, 0, NUM_PAGES)], timeout_s=1)
        peer.proc.kill()
        peer.proc.wait()
        with pytest.raises(TransferError, match="mooncake write of .* to 127.0.0.1:"):
            backend.write(peer.endpoint, [PageRun(0, 0, 2)], timeout_s=30)
        with pytest.raises(TransferError, match="past the peer's KV pool"):
            backend.write(peer.endpoint, [PageRun(0, NUM_PAGES - 1, 2)], timeout_s=30)
    finally:
        backend.close()
    with pytest.raises(TransferError, match="closed"):
        backend.write(peer.endpoint, [PageRun(0, 0, 1)], timeout_s=30)


def test_mismatched_layouts_are_refused(peer):
    ours = make_buffers(2, NUM_PAGES)
    for buffers, match in [(ours[:3], "page bytes per buffer"),
                           ([ours[0].float()] + ours[1:], "page bytes per buffer")]:
        backend = MooncakeBackend(buffers, PAGE_SIZE, host="127.0.0.1")
        try:
            with pytest.raises(ValueError, match=match):
                backend.check_peer(peer.endpoint)
        finally:
            backend.close()
    backend = MooncakeBackend(ours, PAGE_SIZE, host="127.0.0.1")
    try:
        backend.check_peer(peer.endpoint)
        with pytest.raises(ValueError, match="zmq"):
            backend.check_peer({**peer.endpoint, "backend": "zmq"})
        with pytest.raises(ValueError, match="over rdma"):
            backend.check_peer({**peer.endpoint, "protocol": "rdma"})
    finally:
        backend.close()
