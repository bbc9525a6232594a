"""Where moeserve keeps what it builds for itself (the default model, compiled CPU kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$MOESERVE_CACHE, else ~/.cache/moeserve. Not created here."""
    return Path(os.environ.get("MOESERVE_CACHE") or Path.home() / ".cache" / "moeserve")


def touch(path: str | os.PathLike) -> None:
    """Mark a cached file recently used (its mtime now), for the caches that drop the least recently used files
    first; a file gone meanwhile (or read-only) is left as it is."""
    try:
        os.utime(path)
    except OSError:
        pass
