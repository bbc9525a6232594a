"""The decode side's state machine driven by hand through `apply`, as a non-leader rank of an attention group
runs it (no sockets: the events are the leader's): a cancelled room keeps its pages until the writer acknowledges,
and past the transfer timeout without an acknowledgement a backend that cannot refuse late writes (Mooncake's
one-sided writes) keeps them longer than one that can (zmq's windows)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moeserve.disagg.decode import UNGUARDED_HOLD, DecodeRooms
from moeserve.disagg.group import RankGroup
from moeserve.disagg.transfer.base import TransferBackend

TIMEOUT = 10.0


class Backend(TransferBackend):
    name = "fake"

    def __init__(self, guarded: bool):
        super().__init__([torch.randn(16, 3)], 4)
        self.refuses_late_writes = guarded
        self.windows: dict[str, list[int]] = {}

    def endpoint(self) -> dict[str, Any]:
        return {"addr": "fake", "page_bytes": self.page_bytes}

    def write(self, peer, runs, timeout_s):  # decode never writes
        raise AssertionError

    def open_window(self, window, pages):
        self.windows[window] = list(pages)

    def close_window(self, window):
        self.windows.pop(window, None)

    def close(self):
        pass


class Host:
    def __init__(self):
        self.free, self.failed, self.active = [0, 1, 2, 3], [], []

    def pd_reserve(self, req):
        pages, self.free = self.free[:2], self.free[2:]
        return pages

    def pd_release(self, req):
        self.free += [0, 1]

    def pd_activate(self, req, done):
        self.active.append(req)

    def pd_fail(self, req, message, status):
        self.failed.append((req, message, status))


def _events(now: float, **kw) -> list[dict]:
    return [{"now": now, "routes": {}, "msgs": [], "dead": [], "unsent": [], **kw}]


def _cancelled_room(guarded: bool) -> tuple[DecodeRooms, Host, Backend]:
    host, backend = Host(), Backend(guarded)
    group = RankGroup(rank=1, size=2, token="t", endpoints=[{"addr": "a"}, {"addr": "b"}])
    rooms = DecodeRooms(host, backend, None, None, {"page_size": 4}, None, TIMEOUT, TIMEOUT, TIMEOUT, group=group)
    rooms.apply(_events(100.0))
    assert rooms.add("req", 7, "h", 1) is None
    route = {"addr": "tcp://p", "hb": "tcp://hb", "identity": {"page_size": 4}}
    rooms.apply(_events(101.0, routes={1: (True, route)}))  # route known, admitted at once
    assert rooms.counts()["transferring"] == 1 and backend.windows == {"t-1": [0, 1]} and host.free == [2, 3]
    rooms.abort("req")
    assert rooms.counts()["cancelling"] == 1 and host.free == [2, 3]
    return rooms, host, backend


@pytest.mark.parametrize("guarded", [True, False])
def test_cancelled_pages_wait_for_the_writer(guarded):
    rooms, host, backend = _cancelled_room(guarded)
    rooms.apply(_events(101.0 + 1.5 * TIMEOUT))
    if guarded:  # the window is closed first: a late write is dropped, the pages can go
        assert not rooms.busy and sorted(host.free) == [0, 1, 2, 3] and not backend.windows
        return
    assert rooms.counts()["cancelling"] == 1 and host.free == [2, 3]  # a late one-sided write could still land
    rooms.apply(_events(101.0 + (UNGUARDED_HOLD + 0.5) * TIMEOUT))
    assert not rooms.busy and sorted(host.free) == [0, 1, 2, 3]


def test_acknowledgement_or_dead_writer_frees_at_once():
    rooms, host, _ = _cancelled_room(False)
    rooms.apply(_events(102.0, msgs=[{"kind": "failed", "room": 7, "from": "tcp://p", "reason": "cancelled"}]))
    assert not rooms.busy and sorted(host.free) == [0, 1, 2, 3]
    rooms, host, _ = _cancelled_room(False)
    rooms.apply(_events(102.0, dead=["tcp://hb"]))
    assert not rooms.busy and sorted(host.free) == [0, 1, 2, 3]
    assert host.failed == []  # the client was answered by the abort already: no second answer
