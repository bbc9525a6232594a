"""How a checkpoint tensor lands in a parameter: the contract between layers and the loader.

Each layer that holds parameters can say, for each checkpoint tensor it needs, which part of the tensor this rank
reads (`src`) and where it goes in which parameter (`dst`). Layers without a `weight_specs(prefix)` method get the
default: the checkpoint key equals the parameter name and the whole tensor is copied.

A layer may hold parameter elements that no checkpoint tensor fills (FP8 weights padded to whole blocks): it lists
them in `padding_numel` (local parameter name -> element count), and the loader zero-fills those parameters first.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

Index = tuple  # a tuple of ints and slices, as used in tensor[index]


@dataclass(frozen=True)
class WeightSpec:
    """One checkpoint tensor: its key and full shape on disk, and where this rank's part of it goes."""

    key: str  # checkpoint key, e.g. "model.layers.3.mlp.experts.7.up_proj.weight"
    shape: tuple[int, ...]  # full shape expected on disk
    param: str | None  # our parameter name; None: the tensor is expected but this rank does not need it
    src: Index = ()  # part of the checkpoint tensor this rank reads (() = all of it)
    dst: Index = ()  # where it goes in the parameter (() = all of it)


def shard(size: int, tp_size: int, tp_rank: int) -> slice:
    """Rank tp_rank's contiguous part of a dimension of `size` split over tp_size ranks."""
    assert size % tp_size == 0, f"{size} does not split over {tp_size} ranks"
    n = size // tp_size
    return slice(tp_rank * n, (tp_rank + 1) * n)


def block_slice(part: slice, size: int, block: int) -> slice:
    """The blocks of `block` elements that cover `part` of a dimension of `size` (a rank's share of a block-scaled
    weight -> its share of the scales). Raises ValueError unless the part starts on a block boundary and ends on one
    or at the end of the dimension: a block's scale cannot be split between ranks."""
    start, stop = part.start or 0, size if part.stop is None else part.stop
    if start % block or (stop % block and stop != size):
        raise ValueError(f"rows/columns {start}:{stop} of {size} do not fall on {block}-element block boundaries")
    return slice(start // block, -(-stop // block))


def model_weight_specs(model: nn.Module) -> Iterator[WeightSpec]:
    """Every checkpoint tensor the model expects, from each module's `weight_specs` or the default."""
    for prefix, module in model.named_modules():
        direct = list(module.named_parameters(recurse=False))
        if not direct:
            continue
        if hasattr(module, "weight_specs"):
            yield from module.weight_specs(prefix)
            continue
        for name, p in direct:
            key = f"{prefix}.{name}" if prefix else name
            yield WeightSpec(key=key, shape=tuple(p.shape), param=key)
