"""A value derived from a tensor (a packed copy of a weight, say), kept on the tensor and made again when the
tensor is rewritten: in place (its version counter moves, as an EPLB swap or a weight update moves it) or moved to
other storage."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def derived(source: torch.Tensor, name: str, make: Callable[[], T]) -> T:
    """make()'s value for source as it is now: kept as the attribute `name` of source with source's (version, data
    pointer), and made again when either has moved since."""
    stamp = (source._version, source.data_ptr())
    held = getattr(source, name, None)
    if held is None or held[0] != stamp:
        held = (stamp, make())
        setattr(source, name, held)
    return held[1]
