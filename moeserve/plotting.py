"""matplotlib for the figures moeserve writes (EPLB tools, `bench serving --plot`): an optional extra, `plot`."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

MISSING = "matplotlib is not installed: pip install 'moeserve[plot]' (or matplotlib) for the figures"


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def pyplot() -> Any:
    """matplotlib.pyplot drawing to files (the Agg backend: no display needed); RuntimeError when it is absent."""
    if not have_matplotlib():
        raise RuntimeError(MISSING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
