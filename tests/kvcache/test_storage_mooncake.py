"""The mooncake storage backend against a real Mooncake master started here (skipped where Mooncake is not
installed), and its errors when the master or its address is missing."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from moeserve.kvcache.storage.keys import KVLayout, page_keys
from moeserve.kvcache.storage.registry import make_storage
from moeserve.server.launch import free_port
from tests.procs import stop_process


def _master_binary() -> str | None:
    try:
        from moeserve.kvcache.storage.registry import backend_class

        backend_class("mooncake")
    except ValueError:
        return None
    return shutil.which("mooncake_master", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                                  os.environ.get("PATH", "")]))


MASTER = _master_binary()
pytestmark = pytest.mark.skipif(MASTER is None, reason="Mooncake's store is not installed (make install)")
SMALL = {"global_segment_size": 32 << 20, "local_buffer_size": 16 << 20}


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("mooncake") / "master.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([MASTER, f"--rpc_port={port}", f"--metrics_port={free_port()}"], stdout=f,
                                stderr=subprocess.STDOUT)
    try:
        # NOTE: ready is a TCP connection to the RPC port, not a log line: a CI run found the port refusing
        # connections after the master had logged "started".
        deadline = time.monotonic() + 60
        while not _accepts(port):
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, f"mooncake_master did not start: {log.read_text()[-2000:]}"
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        stop_process(proc, timeout=20)


def test_roundtrip_and_threads(master):
    store = make_storage("mooncake", {"master_server_address": master, **SMALL})
    try:
        gen = torch.Generator().manual_seed(0)
        keys = page_keys(KVLayout("m", "bfloat16", 4, "mla:2x(16+8)").root(),
                         np.random.default_rng(0).integers(0, 1000, size=4 * 24), 4)
        pages = {k: torch.randn(2, 4, 24, generator=gen).to(torch.bfloat16) for k in keys}
        assert store.batch_exists(keys) == 0 and store.get(keys[0]) is None
        for k in keys[:3]:
            store.put(k, pages[k])
        assert store.batch_exists(keys) == 3 and store.batch_exists(keys[1:]) == 2
        assert all(torch.equal(store.get(k), pages[k]) for k in keys[:3])
        fp8 = torch.randn(3, 5, generator=gen).to(torch.float8_e4m3fn)
        store.put(keys[-1], fp8)
        assert torch.equal(store.get(keys[-1]).view(torch.uint8), fp8.view(torch.uint8))

        wrong: list[str] = []

        def work(seed: int) -> None:
            rng = np.random.default_rng(seed)
            for _ in range(40):
                k = keys[3 + rng.integers(20)]
                if rng.random() < 0.5:
                    store.put(k, pages[k])
                else:
                    got = store.get(k)
                    if got is not None and not torch.equal(got, pages[k]):
                        wrong.append(k)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads) and not wrong
        s = store.stats()
        assert s["corrupt"] == 0 and s["hits"] >= 4
    finally:
        store.close()


def test_missing_master_or_address():
    with pytest.raises(ValueError, match="master_server_address"):
        make_storage("mooncake", SMALL)
    with pytest.raises(ValueError, match=r"is a master running at 127\.0\.0\.1:1 "):
        make_storage("mooncake", {"master_server_address": "127.0.0.1:1", **SMALL})
