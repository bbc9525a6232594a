"""make_dispatcher's backend choice (no processes): none means allgather when ep_size > 1, bad names fail early."""

from __future__ import annotations

import pytest
import torch

from moeserve.args import ServerArgs
from moeserve.ep import DispatchOptions, make_dispatcher, resolve_backend
from moeserve.ep.local import LocalDispatcher
from moeserve.models.options import dispatch_options

CPU = dict(dtype=torch.float32, device="cpu")


def test_none_means_allgather_with_ep():
    assert resolve_backend("none", 1) == "none"
    assert resolve_backend("none", 2) == "allgather"
    assert resolve_backend("all2all", 2) == "all2all"
    with pytest.raises(ValueError, match="unknown MoE dispatch backend"):
        resolve_backend("deepep", 2)


def test_single_rank_none_is_local():
    assert isinstance(make_dispatcher(dispatch_options(ServerArgs()), 8, 8, hidden_size=16, top_k=2, **CPU),
                      LocalDispatcher)


def test_ep_dispatcher_built_and_checked():
    # ep_size 2 without a process group: only construction is exercised
    d = make_dispatcher(DispatchOptions("all2all"), 8, 4, hidden_size=16, top_k=2, ep_group=None, ep_rank=0,
                        ep_size=2, **CPU)
    assert d.comm_bytes == {"dispatch": 0, "combine": 0}
    with pytest.raises(ValueError, match="deepep-mode"):
        make_dispatcher(DispatchOptions("all2all", deepep_mode="fast"), 8, 4, hidden_size=16, top_k=2, ep_size=2,
                        ep_rank=0, **CPU)
    with pytest.raises(ValueError, match="per rank"):
        make_dispatcher(DispatchOptions("allgather"), 8, 8, hidden_size=16, top_k=2, ep_size=2, ep_rank=0, **CPU)
    eager = make_dispatcher(DispatchOptions("all2all", deepep_mode="low_latency", max_tokens_per_rank=4), 8, 4,
                            hidden_size=16, top_k=2, ep_size=2, ep_rank=1, **CPU)
    assert eager.low_latency.cap == 4 and eager.normal is None


def test_which_steps_each_dispatcher_lets_graphs_capture():
    """Decode graphs need a dispatcher that reads nothing back to the host at decode; piecewise (extend) graphs need
    the same of its extend steps: all2all's normal mode (auto's extend steps) reads the split counts back, so
    piecewise graphs are off there (their capture used to fail midway on a GPU)."""
    local = make_dispatcher(dispatch_options(ServerArgs()), 8, 8, hidden_size=16, top_k=2, **CPU)
    assert local.graph_safe and local.extend_graph_safe
    safe = {}
    for mode in ("auto", "normal", "low_latency"):
        d = make_dispatcher(DispatchOptions("all2all", deepep_mode=mode), 8, 4, hidden_size=16, top_k=2,
                            ep_group=None, ep_rank=0, ep_size=2, **CPU)
        safe[mode] = (d.graph_safe, d.extend_graph_safe)
    assert safe == {"auto": (True, False), "normal": (False, False), "low_latency": (True, True)}
    allgather = make_dispatcher(DispatchOptions("allgather"), 8, 4, hidden_size=16, top_k=2, ep_size=2, ep_rank=0,
                                **CPU)
    assert not allgather.graph_safe and not allgather.extend_graph_safe
