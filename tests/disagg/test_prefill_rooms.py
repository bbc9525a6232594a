"""The prefill side's state machine on a non-leader rank of an attention-TP group, driven by hand through `apply`:
which rank writes what (MLA: the leader alone, to every decode rank; GQA: rank r to decode rank r), and a room
ends only when every writing rank's result is in, failing if any of them failed."""

from __future__ import annotations

import time
from typing import Any

import torch

from moeserve.disagg.group import RankGroup
from moeserve.disagg.prefill import PrefillRooms
from moeserve.disagg.transfer.base import TransferBackend


class Backend(TransferBackend):
    name = "fake"

    def __init__(self):
        super().__init__([torch.randn(16, 3)], 4)
        self.writes: list[tuple[str, list]] = []

    def endpoint(self) -> dict[str, Any]:
        return {"addr": "me", "page_bytes": self.page_bytes}

    def write(self, peer, runs, timeout_s):
        self.writes.append((peer["addr"], list(runs)))
        return 10 * sum(r.num_pages for r in runs)

    def close(self):
        pass


class Host:
    def __init__(self):
        self.queued, self.released, self.finished = [], [], []

    def pd_enqueue(self, req):
        self.queued.append(req)

    def pd_detach(self, req):
        pass

    def pd_src_pages(self, req, num_pages):
        return list(range(8, 8 + num_pages))

    def pd_release(self, req, cache):
        self.released.append((req, cache))

    def pd_finish(self, req, error):
        self.finished.append((req, error))

    def pd_prompt_len(self, req):
        return 6  # two pages of 4


def _events(now: float, results=(), msgs=()) -> dict:
    return {"now": now, "results": list(results), "msgs": list(msgs), "dead": []}


def _started(replicated: bool) -> tuple[PrefillRooms, Host, Backend]:
    """A follower (rank 1 of 2) whose room got decode's `dest` (two decode ranks) and computed the whole prompt."""
    host, backend = Host(), Backend()
    rooms = PrefillRooms(host, backend, None, None, {"page_size": 4}, 4, 30.0, 30.0,
                         group=RankGroup(rank=1, size=2), kv_replicated=replicated)
    rooms.apply([_events(100.0)])
    assert rooms.add("req", 5) is None
    dest = {"kind": "dest", "room": 5, "from": "tcp://d", "hb": "tcp://dhb", "pages": [3, 4],
            "peers": [{"addr": "d0", "page_bytes": backend.page_bytes}, {"addr": "d1", "page_bytes": backend.page_bytes}],
            "identity": {"page_size": 4}}
    rooms.apply([_events(100.5, msgs=[dest])])
    assert host.queued == ["req"]
    rooms.after_extend("req", 6, {"token": 7, "cached_tokens": 0})
    return rooms, host, backend


def _own_results(rooms: PrefillRooms, n: int) -> list:
    deadline = time.monotonic() + 10
    got: list = []
    while len(got) < n and time.monotonic() < deadline:
        got += rooms.collect()["results"]
        time.sleep(0.01)
    return got


def test_gqa_rank_writes_its_heads_and_waits_for_every_rank():
    rooms, host, backend = _started(replicated=False)
    own = _own_results(rooms, 1)
    assert [w[0] for w in backend.writes] == ["d1"]  # rank 1 -> decode rank 1
    assert backend.writes[0][1][0].dst_page == 3 and backend.writes[0][1][0].num_pages == 2  # one merged run
    seq = own[0][0]
    rooms.apply([_events(101.0), {"results": own}])  # the leader's write is not back yet
    assert rooms.busy and host.finished == []
    rooms.apply([_events(101.5, results=[(seq, 20, None, 0.5)]), {"results": []}])
    assert not rooms.busy and host.finished == [("req", None)] and host.released == [("req", True)]
    assert rooms.stats.transfer_bytes == 40  # both ranks' bytes
    assert 0.5 < rooms.stats.write_seconds < 5  # the leader's 0.5 s and the follower's own (measured) write


def test_one_ranks_failed_write_fails_the_room_everywhere():
    rooms, host, _ = _started(replicated=False)
    own = _own_results(rooms, 1)
    rooms.apply([_events(101.0, results=[(own[0][0], 0, "TransferError: boom", 0.1)]), {"results": own}])
    assert not rooms.busy and host.released == [("req", False)]
    assert host.finished[0][1].startswith("KV transfer to decode failed: TransferError: boom")


def test_mla_follower_writes_nothing():
    rooms, host, backend = _started(replicated=True)
    time.sleep(0.05)
    assert backend.writes == [] and rooms.collect()["results"] == [] and not rooms.gathers
    seq = rooms.by_req[id("req")].seq
    rooms.apply([_events(101.0, results=[(seq, 40, None, 0.2)])])  # the leader wrote the latent to both ranks
    assert host.finished == [("req", None)] and rooms.stats.transfer_bytes == 40
