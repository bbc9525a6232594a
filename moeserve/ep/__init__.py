"""Expert-parallel dispatchers: move tokens to the ranks holding their experts and the results back.

base.py: the Dispatcher every backend is; registry.py: backends by name and DispatchOptions (the flags);
local.py, allgather.py, all2all*.py: the backends; routing.py: the tensor code they share; stats.py: the
per-rank expert-utilization counter.
"""

from moeserve.ep.base import Dispatcher
from moeserve.ep.registry import DispatchOptions, make_dispatcher, resolve_backend

__all__ = ["DispatchOptions", "Dispatcher", "make_dispatcher", "resolve_backend"]
