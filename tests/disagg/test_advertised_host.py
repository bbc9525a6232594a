"""The address a PD server advertises to its peers (disagg/control.py advertised_host)."""

from __future__ import annotations

import socket

from moeserve.disagg.control import advertised_host


def test_an_explicit_bind_host_is_advertised_as_given():
    assert advertised_host("10.1.2.3") == "10.1.2.3"
    assert advertised_host("10.1.2.3", "10.9.9.9") == "10.1.2.3"


def test_a_loopback_peer_gets_the_loopback_address():
    assert advertised_host("0.0.0.0", "127.0.0.1") == "127.0.0.1"
    assert advertised_host("0.0.0.0", "localhost") == "127.0.0.1"


def test_a_wildcard_bind_on_one_node_advertises_an_address_that_reaches_it():
    """One-node servers (no peer known) bound to 0.0.0.0 used to advertise 127.0.0.1, which a decode server on
    another machine cannot reach; now the default route's interface, which must reach this wildcard-bound socket."""
    host = advertised_host("0.0.0.0")
    assert host not in ("0.0.0.0", "")
    with socket.socket() as server:
        server.bind(("0.0.0.0", 0))
        server.listen(1)
        with socket.create_connection((host, server.getsockname()[1]), timeout=5):
            conn, _ = server.accept()
            conn.close()
