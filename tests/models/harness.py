"""Test harness: our model on CPU with a KV pool and a simple slot allocator, and the transformers reference."""

from __future__ import annotations

import torch

from moeserve.args import ServerArgs
from moeserve.core.forward_batch import ForwardBatch, ForwardMode
from moeserve.kvcache.kv_pool import make_kv_pool
from moeserve.models.loader import load_model
from moeserve.parallel.state import get_parallel_state

ATOL = RTOL = 1e-4  # fp32 parity with transformers


class Runner:
    """Our model plus a KV pool. Requests are keyed by any hashable id; slots come from a shuffled free list
    (starting at page 1, page 0 is scratch), so a request's cache rows are not contiguous."""

    def __init__(self, path: str, num_slots: int = 2048, seed: int = 0, dtype: str = "float32",
                 device: str = "cpu", **server_args):
        args = ServerArgs(model_path=path, dtype=dtype, device=device, **server_args)
        self.args = args
        self.device = torch.device(device)
        self.model, self.config = load_model(args, self.device, show_progress=False)
        kv_dtype = next(p.dtype for n, p in self.model.named_parameters() if "embed" in n)
        self.pool = make_kv_pool(self.config, num_slots, 1, kv_dtype, self.device,
                                 attn_tp_size=get_parallel_state().attn_tp_size)
        gen = torch.Generator().manual_seed(seed)
        self.free = (torch.randperm(num_slots, generator=gen) + 1).tolist()
        self.slots: dict[object, list[int]] = {}

    def _alloc(self, n: int) -> list[int]:
        out, self.free = self.free[:n], self.free[n:]
        return out

    def batch(self, mode: ForwardMode, reqs: list[tuple[object, list[int]]], return_all_logits: bool = False,
              pad_rows: int = 0) -> ForwardBatch:
        """Each request's new tokens (after whatever it has in the cache) in new slots, then `pad_rows` padding
        requests of one token each, as CudaGraphRunner pads a decode batch (token 0, position 0, scratch slot 0)."""
        ids, seq_lens, ext, loc, kv = [], [], [], [], []
        for rid, toks in reqs:
            new = self._alloc(len(toks))
            self.slots.setdefault(rid, []).extend(new)
            ids += toks
            seq_lens.append(len(self.slots[rid]))
            ext.append(len(toks))
            loc += new
            kv += self.slots[rid]
        for _ in range(pad_rows):
            ids.append(0), seq_lens.append(1), ext.append(1), loc.append(0), kv.append(0)
        return ForwardBatch.build(mode, ids, seq_lens, ext, loc, kv, self.pool, return_all_logits)

    @torch.no_grad()
    def extend(self, reqs: list[tuple[object, list[int]]], return_all_logits: bool = True) -> torch.Tensor:
        """EXTEND with each request's new tokens (after whatever it has in the cache)."""
        batch = self.batch(ForwardMode.EXTEND, reqs, return_all_logits)
        return self.model(batch.to(self.device)).cpu()

    @torch.no_grad()
    def decode(self, reqs: list[tuple[object, int]]) -> torch.Tensor:
        """DECODE one token per request -> logits [B, V]."""
        ids, seq_lens, loc, kv = [], [], [], []
        for rid, tok in reqs:
            (new,) = self._alloc(1)
            self.slots[rid].append(new)
            ids.append(tok)
            seq_lens.append(len(self.slots[rid]))
            loc.append(new)
            kv += self.slots[rid]
        batch = ForwardBatch.build(ForwardMode.DECODE, ids, seq_lens, [1] * len(reqs), loc, kv, self.pool)
        return self.model(batch.to(self.device)).cpu()


class MTPRunner:
    """A Runner's target with its MTP layer (models/mtp.py) over the layer's own KV pool; slots as Runner's. Each
    row is (next token, hidden state) of one position: a request's rows continue its draft sequence."""

    def __init__(self, target: Runner, num_slots: int = 2048, seed: int = 1):
        from moeserve.models.loader import load_mtp

        self.target = target
        self.mtp = load_mtp(target.args, target.model, target.device, show_progress=False)
        self.pool = self.mtp.make_kv_pool(num_slots, 1, target.pool.dtype, target.device)
        gen = torch.Generator().manual_seed(seed)
        self.free = (torch.randperm(num_slots, generator=gen) + 1).tolist()
        self.slots: dict[object, list[int]] = {}

    @torch.no_grad()
    def step(self, mode: ForwardMode, reqs: list[tuple[object, list[int], torch.Tensor]],
             return_all_logits: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's rows (tokens [n], hidden [n, H]) after its earlier ones -> (logits, h_next [T, H])."""
        ids, seq_lens, ext, loc, kv, hidden = [], [], [], [], [], []
        for rid, toks, h in reqs:
            new, self.free = self.free[:len(toks)], self.free[len(toks):]
            self.slots.setdefault(rid, []).extend(new)
            ids += toks
            seq_lens.append(len(self.slots[rid]))
            ext.append(len(toks))
            loc += new
            kv += self.slots[rid]
            hidden.append(h)
        batch = ForwardBatch.build(mode, ids, seq_lens, ext, loc, kv, self.pool, return_all_logits)
        batch = batch.to(self.target.device)
        logits, h_next = self.mtp(batch, batch.input_ids, torch.cat(hidden).to(self.target.device, self.pool.dtype))
        return logits.cpu(), h_next.cpu()


@torch.no_grad()
def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """transformers' logits [len(tokens), V] of one sequence."""
    return hf(torch.tensor([tokens])).logits[0].float()


def random_tokens(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def without_activation_rounding(monkeypatch) -> None:
    """Turn off the FP8 activations' rounding on the CPU (the FP8 layers then multiply the rows as they are by the
    dequantized weights): the layers' own fake quantization, and the norms that hand an FP8 layer its rows already
    quantized give them unrounded, with scales of 1."""
    import moeserve.layers.norm as norm
    import moeserve.layers.quantization.fp8_experts as experts
    import moeserve.layers.quantization.fp8_linear as linear
    import moeserve.layers.quantization.fp8_mlp as mlp
    from moeserve.kernels.fp8_quant import QuantizedRows, num_blocks

    for module in (experts, linear, mlp):
        monkeypatch.setattr(module, "fake_quantize_activations", lambda x: x)

    def unrounded_norm(x, weight, eps, residual=None):
        out = norm.rms_norm(x, weight, eps, residual)
        y, h = out if residual is not None else (out, None)
        rows = QuantizedRows(y, torch.ones(*y.shape[:-1], num_blocks(y.shape[-1])))
        return rows if h is None else (rows, h)

    monkeypatch.setattr(norm, "rms_norm_quant", unrounded_norm)
