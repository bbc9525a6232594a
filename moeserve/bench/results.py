"""Where a benchmark's figures go besides the terminal: one JSON line per result, appended to --result-file."""

from __future__ import annotations

import json
from collections.abc import Iterable


def append_results(path: str | None, rows: Iterable[dict]) -> None:
    """Append each row as one JSON line to `path`; nothing when no file was asked for."""
    if not path:
        return
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
