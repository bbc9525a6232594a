"""Process helpers for tests that start servers: the processes a server spawned, and whether one still lives."""

from __future__ import annotations

import os
from pathlib import Path


def descendants(pid: int) -> set[int]:
    """Every process below pid (children, grandchildren, ...), read from /proc."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except FileNotFoundError:
            continue
        for t in tasks:
            try:
                children = Path(f"/proc/{p}/task/{t}/children").read_text().split()
            except FileNotFoundError:
                continue
            for c in map(int, children):
                if c not in found:
                    found.add(c)
                    todo.append(c)
    return found


def alive(pid: int) -> bool:
    """True while pid runs (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
