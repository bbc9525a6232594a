"""The dispatcher suite (ep_suite.py) on 2 CPU ranks: one gloo group runs every case, the tests read its report."""

from __future__ import annotations

import pytest
from ep_suite import (  # noqa: F401 - pytest collects the imported tests
    test_alignment_pads_some_segment,
    test_auto_resolves_mode,
    test_dispatch,
    test_interleaved_micro_batches,
    test_low_latency_runs_rounds_over_cap,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world() -> int:
    return 2
