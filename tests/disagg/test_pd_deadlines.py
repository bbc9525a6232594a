"""Each PD deadline times what it names (docs/disaggregation.md, "Deadlines"), driven by hand through `apply`:
a room queued at decode is timed at prefill by decode's heartbeat and --disaggregation-waiting-timeout, not the
bootstrap timeout; decode's transfer deadline runs from prefill's `started`, its wait for prefill's queue is
bounded by the waiting timeout (a 429: try later); decode reserves pages ahead of prefill for one batch only;
every failure is counted by cause. And a captured control message replayed is dropped."""

from __future__ import annotations

import time

import zmq

from moeserve.disagg import messages
from moeserve.disagg.control import ControlChannel
from moeserve.disagg.decode import DecodeRooms
from moeserve.disagg.group import RankGroup
from moeserve.disagg.prefill import PrefillRooms
from tests.disagg.test_decode_rooms import Backend as DecodeBackend
from tests.disagg.test_decode_rooms import Host as DecodeHost
from tests.disagg.test_decode_rooms import _events as decode_events
from tests.disagg.test_prefill_rooms import Backend as PrefillBackend
from tests.disagg.test_prefill_rooms import Host as PrefillHost
from tests.disagg.test_prefill_rooms import _events as prefill_events

BOOT, WAIT, XFER = 5.0, 60.0, 3.0
ROUTE = {"addr": "tcp://p", "hb": "tcp://phb", "identity": {"page_size": 4}}


def _decode(ahead_pages: int | None = None) -> tuple[DecodeRooms, DecodeHost]:
    host = DecodeHost()
    group = RankGroup(rank=1, size=2, token="t", endpoints=[{"addr": "a"}, {"addr": "b"}])
    rooms = DecodeRooms(host, DecodeBackend(True), None, None, {"page_size": 4}, None, BOOT, WAIT, XFER,
                        group=group, ahead_pages=ahead_pages)
    rooms.apply(decode_events(100.0))
    return rooms, host


def test_decode_times_the_transfer_from_prefills_start():
    rooms, host = _decode()
    rooms.add("req", 7, "h", 1)
    rooms.apply(decode_events(101.0, routes={1: (True, ROUTE)}))
    assert rooms.counts()["transferring"] == 1
    rooms.apply(decode_events(101.0 + 10 * XFER))  # prefill is busy: the request waits in its queue
    assert rooms.counts()["transferring"] == 1 and host.failed == []
    rooms.apply(decode_events(140.0, msgs=[{"kind": "started", "room": 7, "from": "tcp://p"}]))
    rooms.apply(decode_events(140.0 + XFER / 2))
    assert rooms.counts()["transferring"] == 1
    rooms.apply(decode_events(140.0 + 2 * XFER))  # started and silent past the transfer timeout: that fails
    assert [(m.split(" within")[0], s) for _, m, s in host.failed] == [("the KV transfer did not finish", 503)]
    assert rooms.stats.failures == {"transfer_timeout": 1}


def test_decode_bounds_prefills_queue_by_the_waiting_timeout():
    rooms, host = _decode()
    rooms.add("req", 7, "h", 1)
    rooms.apply(decode_events(101.0, routes={1: (True, ROUTE)}))
    rooms.apply(decode_events(101.0 + WAIT + 1))
    assert host.failed and host.failed[0][2] == 429 and "retry later" in host.failed[0][1]
    assert rooms.stats.failures == {"waiting_timeout": 1} and rooms.stats.to_json()["failed"] == 1


def test_decode_reserves_ahead_only_what_prefill_can_start():
    rooms, host = _decode(ahead_pages=2)  # the fake host reserves 2 pages a request, and has 4
    for room, seq in ((7, 1), (8, 2)):
        rooms.add(f"req{room}", room, "h", 1)
        rooms.apply(decode_events(101.0, routes={seq: (True, ROUTE)}))
    assert rooms.counts() == {"bootstrapping": 0, "waiting": 1, "transferring": 1, "cancelling": 0}
    assert host.free == [2, 3]  # room 8 waits though the pool could hold it
    rooms.apply(decode_events(102.0, msgs=[{"kind": "started", "room": 7, "from": "tcp://p"}]))
    assert rooms.counts()["transferring"] == 2 and host.free == []


def test_aborts_and_failures_are_counted_by_cause():
    rooms, host = _decode()
    rooms.add("req", 7, "h", 1)
    rooms.add("other", 8, "h", 1)
    rooms.apply(decode_events(101.0, routes={1: (True, ROUTE), 2: (False, "boom")}))
    rooms.abort("req")
    assert rooms.stats.failures == {"bootstrap": 1, "aborted": 1}


def _prefill() -> tuple[PrefillRooms, PrefillHost]:
    host = PrefillHost()
    rooms = PrefillRooms(host, PrefillBackend(), None, None, {"page_size": 4}, 4, BOOT, XFER,
                         group=RankGroup(rank=1, size=2), waiting_timeout_s=WAIT)
    rooms.apply([prefill_events(100.0)])
    assert rooms.add("req", 5) is None
    return rooms, host


def test_prefill_waits_while_decode_queues_the_room():
    rooms, host = _prefill()
    wait = {"kind": "wait", "room": 5, "from": "tcp://d", "hb": "tcp://dhb"}
    rooms.apply([prefill_events(101.0, msgs=[wait])])
    assert rooms.rooms[5].decode_hb == "tcp://dhb"  # watched by the heartbeat from now on
    rooms.apply([prefill_events(101.0 + 5 * BOOT)])  # past the bootstrap timeout: decode asked, it waits
    assert host.finished == [] and rooms.busy
    rooms.apply([prefill_events(101.0 + WAIT + 1)])
    assert host.finished and "--disaggregation-waiting-timeout" in host.finished[0][1]
    assert rooms.stats.failures == {"waiting_timeout": 1}


def test_prefill_bootstrap_timeout_without_decode():
    rooms, host = _prefill()
    rooms.apply([prefill_events(100.0 + BOOT + 1)])
    assert host.finished and "--disaggregation-bootstrap-timeout" in host.finished[0][1]
    assert rooms.stats.failures == {"bootstrap_timeout": 1}


def test_replayed_or_stale_control_message_is_dropped():
    a, b = ControlChannel("127.0.0.1", "127.0.0.1", "key"), ControlChannel("127.0.0.1", "127.0.0.1", "key")
    spy = zmq.Context.instance().socket(zmq.PUSH)
    try:
        frames = messages.encode({"kind": "cancel", "room": 5, "from": a.addr}, "key")  # as captured on the wire
        spy.connect(b.addr)
        spy.send_multipart(frames)
        spy.send_multipart(frames)  # the replay
        stale = dict(messages.decode(frames, "key"), ts=time.time() - 2 * messages.MAX_AGE_S, nonce="n")
        body = messages.json.dumps(stale).encode()
        spy.send_multipart([messages.sign(body, "key"), body])
        a.send(b.addr, {"kind": "cancel", "room": 6})
        got: list = []
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            got += b.recv_all()
            time.sleep(0.01)
        time.sleep(0.2)
        got += b.recv_all()
        assert sorted(m["room"] for m in got) == [5, 6]  # the first copy and a fresh message; not the replay
    finally:
        spy.close(linger=0)
        a.close()
        b.close()
