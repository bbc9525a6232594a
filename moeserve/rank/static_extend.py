"""Static-shape extend (prefill and mixed) steps with several DP groups: every group runs one agreed token count.

The decode steps' agreement (rank/static_shape.py) for the steps where some group prefills. The MoE layers are
collective and their dispatch sizes follow the header's `global_num_tokens`; piecewise CUDA graphs fix them per
token bucket. So before an extend step all ranks agree on one padded count N (`StepHeader.padded_extend_size`): the
largest group's token count rounded up to the piecewise buckets (piecewise_graph_runner.token_buckets). Every
group, an idle one included, then runs N rows, and the header is [N] * groups. The agreement needs every rank able
to run its part this way (`static_extend_ready`): an extend, mixed or decode step of at most the largest bucket, or
idle (a group that decodes beside another's prefill pads its decode rows the same way); a rank with a larger step
makes the step run eagerly with exact sizes. Steps where no group prefills are decode steps (rank/static_shape.py).

The padding follows the piecewise runner's: the padded batch is one request of N tokens, the real tokens first,
then padding tokens (token 0 at position 0) whose cache rows go to the scratch slot 0, which no request owns.
Everything but attention (embedding, projections, norms, rotary, the cache write, the MoE with its routing,
dispatch and combine) runs on all N rows: padding rows are routed and dispatched like real ones and their results
dropped, the same way on every rank. Attention runs on the step's own metadata for the real rows (a mixed step's
extend part and decode part each their way, a decode step's rows as decodes); the padding rows attend among
themselves in the scratch slot, so their values stay finite. Only the real rows reach the LM head and sampling; the KV pool's pages, the scheduler's
metrics and (off while it counts: ModelRunner.static_extend_ready) the expert recorder never see the padding.

On a GPU the piecewise runner replays these steps at the agreed count (and falls back to `forward_padded` where a
capture failed); on a CPU, `StaticShapeExtend` runs the same padded step eagerly behind
`--enable-static-shape-extend`, so that CPU tests prove the tokens and the collectives.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from moeserve.core.forward_batch import ForwardBatch, ForwardMode
from moeserve.layers.attention.ops import AttentionMetadata, attend_parts


def padded_extend_size(global_num_tokens: list[int], buckets: list[int]) -> int | None:
    """The token bucket of the largest group's step, or None when it is larger than every bucket or nobody runs."""
    top = max(global_num_tokens, default=0)
    if top <= 0 or top > buckets[-1]:
        return None
    return buckets[bisect.bisect_left(buckets, top)]


def static_extend_ready(batch: ForwardBatch | None, max_tokens: int) -> bool:
    """Whether this rank can run its part of a static-shape extend step (an idle rank always can)."""
    if batch is None or batch.mode.is_idle:
        return True
    return (batch.mode.is_extend or batch.mode.is_decode) and 0 < batch.num_tokens <= max_tokens


def pad_extend(batch: ForwardBatch, size: int, groups: int) -> ForwardBatch:
    """The batch every layer but attention runs: one EXTEND request of `size` tokens, `batch`'s tokens first (an
    EXTEND, MIXED, DECODE or IDLE batch), then padding tokens (token 0 at position 0, cached in the scratch slot 0); its
    header [size] * groups. As the piecewise runner's static batch, with the step's values."""
    t = batch.num_tokens
    assert 0 <= t <= size, (t, size)
    i64 = dict(dtype=torch.int64, device=batch.input_ids.device)
    pad = torch.zeros(size - t, **i64)
    slots = torch.cat([batch.out_cache_loc, pad])
    return ForwardBatch(
        mode=ForwardMode.EXTEND, input_ids=torch.cat([batch.input_ids, pad]),
        positions=torch.cat([batch.positions, pad]), seq_lens=torch.tensor([size], **i64),
        extend_lens=torch.tensor([size], **i64), prefix_lens=torch.zeros(1, **i64), out_cache_loc=slots,
        kv_indices=slots, kv_indptr=torch.tensor([0, size], **i64), qo_indptr=torch.tensor([0, size], **i64),
        kv_pool=batch.kv_pool, seq_lens_cpu=[size], extend_lens_cpu=[size], prefix_lens_cpu=[0],
        global_num_tokens=[size] * groups, any_extend=True,
    )


def padding_only(n: int, kv_pool, device: torch.device) -> ForwardBatch:
    """n padding tokens as one request, every cache row in the scratch slot 0: what the padding rows attend over."""
    return pad_extend(ForwardBatch.idle(kv_pool, device), n, 1)


class PaddedAttention:
    """The PieceSplitter of an eager padded step: each attention call runs the real rows on the step's own
    metadata (`real`, built without rotary: rotary ran on all rows before) and the padding rows on `padding`'s."""

    def __init__(self, real: AttentionMetadata | None, padding: AttentionMetadata | None, num_real: int):
        self.real, self.padding, self.num_real = real, padding, num_real

    def split(self, meta: AttentionMetadata, attend: Callable[..., torch.Tensor],
              rows: tuple[torch.Tensor, ...]) -> torch.Tensor:
        del meta  # the padded batch's: its cache write is done; its one request is not the step's
        t = self.num_real
        outs = []
        if self.real is not None:
            outs.append(attend_parts(self.real, attend, *(r[:t] for r in rows)))
        if self.padding is not None:
            outs.append(attend_parts(self.padding, attend, *(r[t:] for r in rows)))
        return torch.cat(outs) if len(outs) > 1 else outs[0]


def forward_padded(model, batch: ForwardBatch, size: int, groups: int) -> torch.Tensor:
    """Logits of `batch`'s rows (as model.forward gives them) from one eager step padded to `size` tokens (the
    module doc): model is the CausalLM, batch's tensors on the device."""
    t = batch.num_tokens
    padded = pad_extend(batch, size, groups)
    real = AttentionMetadata.build(batch, None) if t else None
    padding = (AttentionMetadata.build(padding_only(size - t, batch.kv_pool, batch.input_ids.device), None)
               if size > t else None)
    hidden = model.hidden_states(padded, pieces=PaddedAttention(real, padding, t))
    return model.compute_logits(hidden[:t], batch)  # (an idle batch's logits_indices are empty)


class StaticShapeExtend:
    """The static-shape extend step without piecewise CUDA graphs (a CPU, or --disable-cuda-graph): the padded
    step, eagerly. A graph runner for ModelRunner (can_run / run / capture_all)."""

    def __init__(self, model, token_buckets: list[int], groups: int):
        self.model = model  # the CausalLM
        self.groups = groups
        self.buckets = token_buckets  # the piecewise graphs' (piecewise_graph_runner.token_buckets)
        self.max_tokens = token_buckets[-1]
        self.num_steps = 0  # padded steps run, and the padding tokens they computed
        self.padded_tokens = 0

    def capture_all(self, progress: bool = True) -> None:
        del progress  # nothing to capture

    def ready(self, batch: ForwardBatch | None) -> bool:
        return static_extend_ready(batch, self.max_tokens)

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.static_num_tokens is not None and self.ready(batch)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        self.num_steps += 1
        self.padded_tokens += batch.static_num_tokens - batch.num_tokens
        return forward_padded(self.model, batch, batch.static_num_tokens, self.groups)


__all__ = ["PaddedAttention", "StaticShapeExtend", "forward_padded", "pad_extend", "padded_extend_size",
           "padding_only", "static_extend_ready"]

