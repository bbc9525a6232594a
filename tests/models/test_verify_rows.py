"""A verify step (and a draft extend over accepted tokens, of 1 to k + 1 tokens per request) as decode rows
(moeserve/rank/speculative/verify_rows.py) against the same step as an extend: the final-normed hidden states and
logits of every row agree in float32, on ragged batches (requests of different lengths, slots scattered over the
pool), for DeepSeek-V3/V2 (MLA: the absorbed decode path against the expanded
extend), a GQA MoE model (the torch decode path), and the shipped default model.

The extend path is the reference: it is the one checked against transformers (test_parity.py)."""

from __future__ import annotations

import pytest
import torch

from moeserve.core.forward_batch import ForwardMode
from moeserve.models.default_model import default_model_path
from moeserve.rank.speculative.verify_rows import extend_as_decode, verify_as_decode
from tests.models.harness import ATOL, RTOL, Runner, random_tokens

PROMPTS = [7, 23, 1, 40]  # tokens each request holds in the cache before the verify step


def _hidden_and_logits(runner: Runner, batch) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        h = runner.model.head_hidden_states(batch)
        return h, runner.model.head_logits(h)


def _check(path: str, num_rows: int | list[int], seed: int) -> None:
    """num_rows: a verify step's tokens per request, or a list (one count per request) for a ragged extend."""
    runner = Runner(path)
    vocab = runner.config.vocab_size
    reqs = [(i, random_tokens(n, seed + i, vocab)) for i, n in enumerate(PROMPTS)]
    runner.extend(reqs)
    counts = num_rows if isinstance(num_rows, list) else [num_rows] * len(PROMPTS)
    step = [(i, random_tokens(n, seed + 100 + i, vocab)) for i, n in enumerate(counts)]
    verify = runner.batch(ForwardMode.EXTEND, step, return_all_logits=True)
    rows = extend_as_decode(verify) if isinstance(num_rows, list) else verify_as_decode(verify, num_rows)
    assert rows.mode.is_decode and rows.num_tokens == verify.num_tokens == sum(counts)
    # both write the same slots with the same rows: the extend runs second, so it reads only its own writes
    h_rows, logits_rows = _hidden_and_logits(runner, rows)
    h_ext, logits_ext = _hidden_and_logits(runner, verify)
    torch.testing.assert_close(h_rows, h_ext, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(logits_rows, logits_ext, atol=ATOL, rtol=RTOL)
    assert logits_ext.std() > 1e-3  # (not a degenerate model)


@pytest.mark.parametrize("num_rows", [2, 4])
@pytest.mark.parametrize("name", ["v3_q_lora", "v3_no_q_lora", "v2_lite", "qwen3_moe"])
def test_verify_rows_equal_extend(tiny_checkpoint, name, num_rows):
    _check(tiny_checkpoint(name), num_rows, seed=3)


@pytest.mark.parametrize("name", ["v3_q_lora", "qwen3_moe"])
def test_ragged_extend_rows_equal_extend(tiny_checkpoint, name):
    """A round's draft extend over the last round's accepted tokens: a different count per request."""
    _check(tiny_checkpoint(name), [3, 1, 4, 2], seed=11)


def test_verify_rows_equal_extend_default_model():
    _check(str(default_model_path()), 3, seed=5)


def test_row_slots_are_causal_prefixes(tiny_checkpoint):
    """Row j of a request reads the request's first L + j + 1 slots (as kv_indices and as the padded decode_slots),
    and writes the slot of its own token."""
    runner = Runner(tiny_checkpoint("v3_q_lora"))
    runner.extend([(0, random_tokens(5, 1)), (1, random_tokens(2, 2))])
    verify = runner.batch(ForwardMode.EXTEND, [(0, random_tokens(3, 3)), (1, random_tokens(3, 4))])
    rows = verify_as_decode(verify, 3)
    assert rows.seq_lens_cpu == [6, 7, 8, 3, 4, 5]
    assert rows.positions.tolist() == [5, 6, 7, 2, 3, 4]
    assert torch.equal(rows.out_cache_loc, verify.out_cache_loc)
    assert torch.equal(rows.input_ids, verify.input_ids)
    for r, (rid, n) in enumerate(zip([0, 0, 0, 1, 1, 1], rows.seq_lens_cpu, strict=True)):
        got = rows.kv_indices[rows.kv_indptr[r]:rows.kv_indptr[r + 1]].tolist()
        assert got == runner.slots[rid][:n]
    # the padded block the torch / Triton kernels and the verify's CUDA graphs read: the same slots, padded
    assert rows.decode_slots.shape == (6, 8)
    for r, n in enumerate(rows.seq_lens_cpu):
        assert rows.decode_slots[r, :n].tolist() == rows.kv_indices[rows.kv_indptr[r]:rows.kv_indptr[r + 1]].tolist()


def test_ragged_row_slots_are_causal_prefixes(tiny_checkpoint):
    """extend_as_decode with 1 and 3 tokens per request: each row its request's causal prefix, padded alike."""
    runner = Runner(tiny_checkpoint("v3_q_lora"))
    runner.extend([(0, random_tokens(5, 1)), (1, random_tokens(2, 2))])
    ext = runner.batch(ForwardMode.EXTEND, [(0, random_tokens(1, 3)), (1, random_tokens(3, 4))])
    rows = extend_as_decode(ext)
    assert rows.seq_lens_cpu == [6, 3, 4, 5]
    assert rows.positions.tolist() == [5, 2, 3, 4]
    assert torch.equal(rows.out_cache_loc, ext.out_cache_loc) and torch.equal(rows.input_ids, ext.input_ids)
    assert rows.decode_slots.shape == (4, 6)
    for r, (rid, n) in enumerate(zip([0, 1, 1, 1], rows.seq_lens_cpu, strict=True)):
        got = rows.kv_indices[rows.kv_indptr[r]:rows.kv_indptr[r + 1]].tolist()
        assert got == runner.slots[rid][:n] == rows.decode_slots[r, :n].tolist()
