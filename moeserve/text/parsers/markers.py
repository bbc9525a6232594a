"""Markers in streamed text: how much of a delta's tail may be the start of a marker the next delta completes."""

from __future__ import annotations


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of text could be the start of marker (held back until the next delta)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
