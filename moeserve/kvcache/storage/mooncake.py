"""The `mooncake` storage backend: pages as objects in Mooncake's distributed store (MooncakeDistributedStore).

The store is a pool of memory (and optionally SSD) that the clients of one master contribute to and share, so the
servers of a cluster find each other's pages. It needs the `mooncake` package (mooncake-transfer-engine) and a
running master (`mooncake_master`); with the default P2P handshake no metadata server is needed. Mooncake reports
failures by return code: every one is checked, and a failed put or get is a declined write or a miss.
"""

from __future__ import annotations

import logging

from moeserve.kvcache.storage.base import StorageBackend

logger = logging.getLogger(__name__)

try:
    from mooncake.store import MooncakeDistributedStore
except ImportError as e:  # the package, or a system library it links against
    raise ImportError(
        f"Mooncake's store is not installed ({e}): `pip install mooncake-transfer-engine` (CUDA machines) or "
        "`mooncake-transfer-engine-non-cuda`, or use --hicache-storage-backend file") from e


class MooncakeStorage(StorageBackend):
    """Pages in the Mooncake store whose master is at `master_server_address` (host:port).

    global_segment_size: bytes of this process's memory contributed to the pool; local_buffer_size: this client's
    transfer buffer (at least one page). protocol "tcp" or "rdma" over `device_name` (e.g. "mlx5_0")."""

    def __init__(self, master_server_address: str | None = None, metadata_server: str = "P2PHANDSHAKE",
                 local_hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "",
                 global_segment_size: int = 1 << 30, local_buffer_size: int = 128 << 20):
        super().__init__()
        if not master_server_address:
            raise ValueError("the mooncake KV storage backend needs its master's address: pass "
                             '{"master_server_address": "host:port"} in the backend\'s config, and start the master '
                             "with `mooncake_master` (its default port is 50051)")
        self.master = master_server_address
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(local_hostname, metadata_server, global_segment_size, local_buffer_size, protocol,
                               device_name, master_server_address)
        if rc != 0:
            raise ValueError(
                f"Mooncake's store did not start (setup returned {rc}): is a master running at "
                f"{master_server_address} (`mooncake_master --rpc_port ...`)"
                + ("" if metadata_server == "P2PHANDSHAKE" else f" and a metadata server at {metadata_server}")
                + f", and is {local_hostname} this machine's address?")
        logger.info("KV storage: Mooncake store, master %s, %.0f MiB contributed", master_server_address,
                    global_segment_size / 2**20)

    def _read(self, key: str) -> bytes | None:
        data = self._store.get(key)
        return data if data else None  # empty bytes: absent, or the get failed

    def _exists(self, key: str) -> bool:
        return self._store.is_exist(key) == 1

    def batch_exists(self, keys) -> int:
        keys = list(keys)
        if not keys:
            return 0
        for i, found in enumerate(self._store.batch_is_exist(keys)):
            if found != 1:  # 0 absent, -1 the lookup failed: a miss either way
                return i
        return len(keys)

    def _write(self, key: str, data: bytes) -> bool:
        if self._exists(key):
            return False
        rc = self._store.put(key, data)
        if rc != 0:
            logger.debug("KV storage: Mooncake put of %s failed (%d)", key, rc)
        return rc == 0

    def _delete(self, key: str) -> None:
        self._store.remove(key)

    def close(self) -> None:
        self._store.close()
