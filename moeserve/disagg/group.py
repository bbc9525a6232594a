"""Where a rank sits in its attention-TP group, for PD disaggregation.

Every rank of an attention group runs the same scheduler on the same inputs (rank/rank_sync.py), so each side's
PD state machine runs on every rank of the group too, fed the same events: the group's leader alone talks to the
peer side (control messages, bootstrap lookups, heartbeats) and broadcasts what it saw with the step's messages;
the others only apply it. Every rank holds its own KV pool and transfer backend: MLA's latent is the same on every
rank, so one prefill rank (the leader) reads it and writes it to each decode rank; GQA's KV heads are split over
the ranks, so prefill rank r writes its heads to decode rank r (both sides need the same attention TP size).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RankGroup:
    """rank / size: this rank's place in its attention-TP group. token: the same on every rank of the group (it
    names the group's transfer windows). endpoints: every rank's transfer endpoint, in rank order."""

    rank: int = 0
    size: int = 1
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    endpoints: list[dict[str, Any]] = field(default_factory=list)

    @property
    def leader(self) -> bool:
        return self.rank == 0
