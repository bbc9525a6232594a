"""Transfer backends by name (--disaggregation-transfer-backend). Mooncake is imported only when asked for: its
package (and the system libraries it loads) need not be installed for the zmq backend."""

from __future__ import annotations

import importlib

from moeserve.args import TRANSFER_BACKENDS as BACKENDS  # name -> (module, class)
from moeserve.disagg.transfer.base import TransferBackend


def backend_class(name: str) -> type[TransferBackend]:
    """The class of backend `name`; ValueError saying what to install or which flag to use when it cannot load."""
    if name not in BACKENDS:
        raise ValueError(f"unknown KV transfer backend {name!r}: choose one of {', '.join(BACKENDS)}")
    module, cls = BACKENDS[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, OSError, AttributeError) as e:
        if name == "mooncake":
            raise ValueError(
                f"the mooncake KV transfer backend cannot load ({type(e).__name__}: {e}). Install it (`make install` "
                "installs mooncake-transfer-engine and the system libraries it needs: libibverbs1, librdmacm1, "
                "liburing2, libnuma1, libcurl4), or start both servers with --disaggregation-transfer-backend zmq"
            ) from None
        raise
