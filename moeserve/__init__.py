"""moeserve: serve huge Mixture-of-Experts language models.

    import moeserve
    engine = moeserve.Engine(model_path="DIR", tp_size=2)   # any ServerArgs flag as a keyword
"""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "ServerArgs"]


def __getattr__(name: str) -> Any:  # imported on first use: `import moeserve` stays light
    if name == "Engine":
        from moeserve.server.engine import Engine

        return Engine
    if name == "ServerArgs":
        from moeserve.args import ServerArgs

        return ServerArgs
    raise AttributeError(f"module 'moeserve' has no attribute {name!r}")
