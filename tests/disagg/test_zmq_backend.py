"""The zmq KV transfer backend between two backends in one process (its receiver is a thread): random page runs
land exactly in every buffer and nowhere else; a write outside the request's window, after the window closed, or
with a bad signature is refused and changes nothing; a peer that never answers is a TransferError after the
timeout. Also the control messages' signatures and the bootstrap server's key."""

from __future__ import annotations

import pytest
import torch

from moeserve.disagg import messages
from moeserve.disagg.bootstrap import BootstrapError, BootstrapServer, lookup_route
from moeserve.disagg.transfer.base import TransferError, merge_runs
from moeserve.disagg.transfer.zmq_backend import ZmqBackend
from moeserve.server.launch import free_port

PAGE = 4


def _buffers(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16 * PAGE, 3, 5, generator=g), torch.randn(16 * PAGE, 7, generator=g).to(torch.bfloat16)]


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def pair(request):
    """Two backends over random KV buffers on the device (CUDA: the copies go through HostStaging)."""
    src, dst = [ZmqBackend([b.to(request.param) for b in _buffers(seed)], PAGE, api_key="k") for seed in (0, 1)]
    yield src, dst
    src.close()
    dst.close()


def test_runs_land_exactly(pair):
    src, dst = pair
    for _ in range(2):  # twice: the second write reuses the threads' staging buffers
        _write_and_check(src, dst)


def _write_and_check(src: ZmqBackend, dst: ZmqBackend) -> None:
    before = [b.clone() for b in dst.buffers]
    src_pages, dst_pages = [2, 3, 4, 9, 10], [5, 6, 7, 12, 1]
    runs = merge_runs(src_pages, dst_pages)
    assert len(runs) == 3  # 2-4 -> 5-7, 9 -> 12, 10 -> 1
    peer = {**dst.endpoint(), "window": "w1"}
    dst.open_window("w1", dst_pages)
    for b in src.buffers:  # fresh contents each time
        b.copy_(torch.randn(b.shape, dtype=torch.float32).to(b.dtype))
    nbytes = src.write(peer, runs, timeout_s=10)
    assert nbytes == sum(len(src_pages) * pb for pb in src.page_bytes)
    for s_buf, d_buf, old in zip(src.buffers, dst.buffers, before, strict=True):
        expect = old.clone()
        for s, d in zip(src_pages, dst_pages, strict=True):
            expect[d * PAGE : (d + 1) * PAGE] = s_buf[s * PAGE : (s + 1) * PAGE]
        assert torch.equal(d_buf, expect)


def test_refused_writes_change_nothing(pair):
    src, dst = pair
    before = [b.clone() for b in dst.buffers]
    peer = {**dst.endpoint(), "window": "w"}
    dst.open_window("w", [5, 6])
    with pytest.raises(TransferError, match="outside the request's window"):
        src.write(peer, merge_runs([1, 2, 3], [5, 6, 7]), timeout_s=10)
    dst.close_window("w")
    with pytest.raises(TransferError, match="window closed"):
        src.write(peer, merge_runs([1], [5]), timeout_s=10)
    stranger = ZmqBackend(_buffers(2), PAGE, api_key="other")
    dst.open_window("w2", [5])
    try:
        with pytest.raises(TransferError):
            stranger.write({**peer, "window": "w2"}, merge_runs([1], [5]), timeout_s=2)
    finally:
        stranger.close()
    assert all(torch.equal(a, b) for a, b in zip(before, dst.buffers, strict=True))


def test_silent_peer_times_out():
    import zmq

    ctx = zmq.Context()
    sink = ctx.socket(zmq.ROUTER)  # takes the bytes, never answers
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    src = ZmqBackend(_buffers(0), PAGE)
    try:
        with pytest.raises(TransferError, match="no acknowledgement"):
            src.write({"addr": f"tcp://127.0.0.1:{port}", "window": "w"}, merge_runs([1], [1]), timeout_s=0.5)
    finally:
        src.close()
        sink.close(linger=0)
        ctx.term()


def test_control_messages_are_signed():
    frames = messages.encode({"kind": "cancel", "room": 5, "from": "tcp://x:1"}, "key")
    assert messages.decode(frames, "key")["room"] == 5
    with pytest.raises(messages.BadMessage, match="bad signature"):
        messages.decode(frames, "other")
    with pytest.raises(messages.BadMessage, match="bad signature"):
        messages.decode([b"", frames[1]], "key")
    with pytest.raises(messages.BadMessage, match="unknown"):
        messages.decode(messages.encode({"kind": "done"}, None)[:1] + [b'{"kind": "rm -rf"}'], None)


def test_bootstrap_server_needs_the_key():
    port = free_port()
    server = BootstrapServer("127.0.0.1", port, "key", 1)
    try:
        server.register({"dp_rank": 0, "addr": "tcp://127.0.0.1:1", "hb": "tcp://127.0.0.1:2", "identity": {}})
        server.assign_room(42, 0)
        assert lookup_route("127.0.0.1", port, 42, "key", 1.0)["addr"] == "tcp://127.0.0.1:1"
        with pytest.raises(BootstrapError, match="401"):
            lookup_route("127.0.0.1", port, 42, None, 1.0)
        with pytest.raises(BootstrapError, match="did not receive room 7"):
            lookup_route("127.0.0.1", port, 7, "key", 0.3)
    finally:
        server.close()
