"""Piecewise CUDA graphs for extend and mixed steps (moeserve/rank/piecewise_graph_runner.py).

On CPU: the buckets, and the model's cut points (every layer's attention goes through the capture's splitter, the
forward is hidden_states then compute_logits). On a GPU: an engine whose extend steps replay from piecewise graphs
gives the tokens and logprobs of the same engine with them off, over prompts of mixed lengths, prefix-cache hits,
chunked prefill and mixed steps, on the MLA and the GQA models; and the graphs really ran, padded.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from moeserve.core.forward_batch import ForwardBatch, ForwardMode
from moeserve.layers.attention.ops import attend_parts
from moeserve.rank.piecewise_graph_runner import _Capture, token_buckets
from moeserve.rank.sampling_params import SamplingParams
from tests.checkpoints import build_checkpoint
from tests.rank.inprocess import InProcessEngine
from tests.rank.test_generation import _prompts
from tests.rank.test_mixed_chunk import _waves, drive

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_token_buckets():
    b = token_buckets(4096)
    assert b[0] == 8 and b[-1] == 4096 and b == sorted(set(b))
    assert all(hi <= 1.5 * lo for lo, hi in zip(b[3:], b[4:], strict=False))  # at most a third of a step is padding
    assert token_buckets(100) == [8, 16, 32, 64, 96, 100]
    assert token_buckets(5) == [5]


class _Recorder:
    """A splitter that runs each attention as it comes and counts the cuts."""

    def __init__(self):
        self.calls = 0

    def split(self, meta, attend, rows):
        self.calls += 1
        return attend_parts(dataclasses.replace(meta, pieces=None), attend, *rows)


@pytest.mark.parametrize("name", ["v3_groups", "mixtral"])
def test_every_attention_is_a_cut(tmp_path, name):
    eng = InProcessEngine(model_path=build_checkpoint(name, tmp_path / name), dtype="float32", device="cpu")
    model, pool = eng.runner.model, eng.runner.kv_pool
    lens = [5, 9]
    ids = [t for n, seed in zip(lens, (1, 2), strict=True) for t in _prompts(seed, [n])[0]]
    batch = ForwardBatch.build(ForwardMode.EXTEND, ids, lens, lens, list(range(1, 15)), list(range(1, 15)), pool)
    with torch.inference_mode():
        whole = model(batch)
        rec = _Recorder()
        cut = model.compute_logits(model.hidden_states(batch, pieces=rec), batch)
    assert rec.calls == len(model.model.layers)
    torch.testing.assert_close(cut, whole, rtol=0, atol=0)


GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def _engines(path, **kw):
    common = dict(model_path=path, device="cuda", dtype="float32", max_total_tokens=4096, cuda_graph_max_bs=16,
                  piecewise_cuda_graph_max_tokens=256, **kw)
    return InProcessEngine(disable_piecewise_cuda_graph=True, **common), InProcessEngine(**common)


@cuda
@pytest.mark.parametrize("name", ["v3_groups", "qwen3_moe"])
def test_piecewise_equals_eager(tmp_path, name):
    path = build_checkpoint(name, tmp_path / name)
    eager, graphed = _engines(path, chunked_prefill_size=64)
    assert eager.runner.piecewise is None and graphed.runner.piecewise is not None
    shared = _prompts(7, [40])[0]
    # mixed lengths (one over the chunk: chunked prefill), then prompts that hit the first ones' cached prefix
    waves = [_prompts(3, [5, 17, 90, 2, 33]), _prompts(4, [6, 21], prefix=shared), _prompts(5, [3], prefix=shared)]
    outs = {}
    for label, eng in (("eager", eager), ("graphed", graphed)):
        got = [eng.run(w, GREEDY, return_logprob=True) for w in waves]
        outs[label] = [r for wave in got for r in wave]
    assert [r["output_ids"] for r in outs["graphed"]] == [r["output_ids"] for r in outs["eager"]]
    assert outs["graphed"][-1]["cached_tokens"] >= len(shared) - 1  # the last wave hit the prefix the one before cached
    for a, b in zip(outs["graphed"], outs["eager"], strict=True):
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4)
    runner = graphed.runner.piecewise
    assert runner.replays >= len(waves) + 1 and runner.padded_tokens > 0  # it ran, on padded steps
    assert all(b is not None for b in runner.captured.values())


@cuda
def test_piecewise_mixed_steps(tmp_path):
    path = build_checkpoint("v3_groups", tmp_path / "m")
    eager, graphed = _engines(path, enable_mixed_chunk=True, chunked_prefill_size=32)
    waves = _waves(11, [9, 30], [50, 4], [17])
    got = {}
    for label, eng in (("eager", eager), ("graphed", graphed)):
        outs, modes = drive(eng, waves, GREEDY, return_logprob=True)
        assert ForwardMode.MIXED in modes
        got[label] = outs
    assert [r["output_ids"] for r in got["graphed"]] == [r["output_ids"] for r in got["eager"]]
    for a, b in zip(got["graphed"], got["eager"], strict=True):
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4)
    assert graphed.runner.piecewise.replays > 0


@cuda
def test_a_capture_that_fails_midway_ends():
    """A piece that syncs with the host fails its capture; `abandon` ends it, so the stream syncs again (before, the
    next sync failed with 'operation not permitted when stream is capturing' and start-up died)."""
    runner = SimpleNamespace(stream=torch.cuda.Stream(), pool=torch.cuda.graph_pool_handle())
    cap = _Capture(runner, 8)
    x = torch.randn(8, device="cuda")
    with torch.cuda.stream(runner.stream):
        cap.begin()
        with pytest.raises(RuntimeError):
            (x * 2).sum().item()
        cap.abandon()
        assert not torch.cuda.is_current_stream_capturing()
    torch.cuda.synchronize()
    assert torch.equal(x * 2, x + x) and cap.graph is None and not cap.bucket.graphs
