"""Model tests run tiny shapes: one intra-op thread is faster than two, and far faster on a busy machine. The `isa`
fixture runs a CPU kernel test once per ISA build the CPU has (kernels/cpu_isa.py)."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels import cpu_isa


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=cpu_isa.ISAS)
def isa(request):
    """The CPU kernels forced to one ISA build for the test, then back to the process's pick."""
    if request.param not in cpu_isa.supported():
        pytest.skip(f"this CPU lacks {request.param}: no {', '.join(cpu_isa.missing(request.param))}")
    before = cpu_isa.current()
    cpu_isa.select(request.param)
    yield request.param
    cpu_isa.select(before)
