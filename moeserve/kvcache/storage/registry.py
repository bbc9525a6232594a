"""Storage backends by name (--hicache-storage-backend), each imported only when asked for: Mooncake's package need
not be installed for the file backend. args.py takes the flag's choices from BACKEND_NAMES."""

from __future__ import annotations

import importlib
import inspect
import json
from typing import Any

from moeserve.kvcache.storage.base import StorageBackend

STORAGE_BACKENDS = {  # name -> (module, class)
    "file": ("moeserve.kvcache.storage.file", "FileStorage"),
    "mooncake": ("moeserve.kvcache.storage.mooncake", "MooncakeStorage"),
}
BACKEND_NAMES = tuple(STORAGE_BACKENDS)


def backend_class(name: str) -> type[StorageBackend]:
    """The class of backend `name`; ValueError saying what is missing when it cannot load."""
    if name not in STORAGE_BACKENDS:
        raise ValueError(f"unknown KV storage backend {name!r}: choose one of {', '.join(BACKEND_NAMES)}")
    module, cls = STORAGE_BACKENDS[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise ValueError(f"the {name} KV storage backend cannot load: {e}") from None


def parse_config(config: str | dict[str, Any] | None) -> dict[str, Any]:
    """A backend's settings from a JSON object (a flag's value), a dict, or None (the defaults)."""
    if config is None or config == "":
        return {}
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as e:
            raise ValueError(f"the KV storage backend's config is not JSON ({e}): {config!r}") from None
    if not isinstance(config, dict):
        raise ValueError(f"the KV storage backend's config is a JSON object, got {config!r}")
    return config


def make_storage(name: str, config: str | dict[str, Any] | None = None) -> StorageBackend:
    """Backend `name` made with `config`'s settings (the keyword arguments of its class); ValueError naming the
    settings it takes when given others."""
    cls = backend_class(name)
    settings = parse_config(config)
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(settings) - set(accepted))
    if unknown:
        raise ValueError(f"the {name} KV storage backend has no setting {', '.join(unknown)} "
                         f"(it takes {', '.join(accepted)})")
    return cls(**settings)
