"""Which model class serves which Hugging Face architecture (moeserve/models/<family>.py, imported lazily)."""

from __future__ import annotations

import importlib

from torch import nn

from moeserve.core.model_config import ARCHITECTURES, SUPPORTED_ARCHITECTURES


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return getattr(importlib.import_module(f"moeserve.models.{ARCHITECTURES[architecture]}"), architecture)
