"""The bootstrap server with --api-key: its /health answers anyone (a probe) but names the registered prefill ranks
only to a caller with the key; registering and routing need the key."""

from __future__ import annotations

import httpx

from moeserve.disagg.bootstrap import BootstrapServer


def test_bootstrap_health_hides_ranks_without_the_key():
    server = BootstrapServer("127.0.0.1", 0, "key", 1)
    try:
        url = f"http://127.0.0.1:{server.port}"
        auth = {"Authorization": "Bearer key"}
        assert httpx.put(url + "/register", json={"dp_rank": 0, "addr": "tcp://x:1"}, timeout=10).status_code == 401
        assert httpx.put(url + "/register", json={"dp_rank": 0, "addr": "tcp://x:1"}, headers=auth,
                         timeout=10).status_code == 200
        open_health = httpx.get(url + "/health", timeout=10)
        assert open_health.status_code == 200 and open_health.json() == {"status": "ok"}
        assert httpx.get(url + "/health", headers=auth, timeout=10).json()["registered"] == [0]
        assert httpx.get(url + "/route?room=1", timeout=10).status_code == 401
    finally:
        server.close()
