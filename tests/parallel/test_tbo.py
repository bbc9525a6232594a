"""Two-batch overlap (--enable-two-batch-overlap) end to end: greedy tokens identical to the run without it.

- One rank, in process: TBO on (tbo_token_threshold 1, so every step with a token overlaps: prefill steps with a
  prompt cut between the micro-batches, decode steps split by sequences, a one-request step with an empty B) vs
  off, then a second round whose prompts share a cached prefix (EXTEND with prefix_lens > 0).
- Two ranks with TBO on (attention TP / DP x every backend x every architecture, against the single-rank run): in
  test_ep_generation.py. Under DP attention a lone request leaves one group IDLE: it must still run two (empty)
  micro-batches, or the collectives would not pair up and the run would hang; that case is there too.
"""

from __future__ import annotations

import random

import pytest

import moeserve.models.tbo as tbo_mod
from moeserve.rank.sampling_params import SamplingParams
from tests.checkpoints import VOCAB
from tests.rank.inprocess import InProcessEngine

NEW_TOKENS = 24
MIXED = [5, 17, 33, 9, 64, 2]
GREEDY = dict(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in MIXED]


_REF: dict[str, list[list[int]]] = {}


def _reference(name: str, path: str) -> list[list[int]]:
    if name not in _REF:
        eng = InProcessEngine(model_path=path, dtype="float32")
        _REF[name] = [r["output_ids"] for r in eng.run(_prompts(), SamplingParams(**GREEDY))]
    return _REF[name]


@pytest.mark.parametrize("name", ["v3_groups", "qwen3_moe"])
def test_single_rank_tbo_matches(tiny_checkpoint, monkeypatch, name):
    path = tiny_checkpoint(name)
    calls = []
    real = tbo_mod.split_batch

    def counting(batch):
        a, b = real(batch)
        calls.append((batch.mode, a.batch_size, b.batch_size, batch.batch_size))
        return a, b

    monkeypatch.setattr(tbo_mod, "split_batch", counting)
    rng = random.Random(2)
    shared = [rng.randrange(2, VOCAB) for _ in range(20)]
    second = [shared + [rng.randrange(2, VOCAB) for _ in range(n)] for n in (3, 11, 1)]
    outs = {}
    for tbo in (False, True):
        eng = InProcessEngine(model_path=path, dtype="float32", enable_two_batch_overlap=tbo, tbo_token_threshold=1)
        first = [r["output_ids"] for r in eng.run(_prompts(), SamplingParams(**GREEDY))]
        eng.run([shared], SamplingParams(max_new_tokens=1, temperature=0.0))  # cache the shared prefix
        res = eng.run(second, SamplingParams(**GREEDY))
        assert all(r["cached_tokens"] >= 16 for r in res), [r["cached_tokens"] for r in res]
        outs[tbo] = (first, [r["output_ids"] for r in res])
        assert bool(calls) == tbo
    assert outs[True] == outs[False]
    assert outs[False][0] == _reference(name, path)
    # prefill steps cut a prompt between A and B; decode steps split by sequences
    assert any(m.is_extend and a + b == n + 1 for m, a, b, n in calls)
    assert any(m.is_decode and a == (n + 1) // 2 and b == n // 2 for m, a, b, n in calls)


# Two ranks with TBO on: the whole attention x backend x architecture matrix is in test_ep_generation.py.
