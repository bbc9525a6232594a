"""The Triton argmax-or-no-token (argmax_or_none) against the torch reference, and where the dispatch sends
a call."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels import argmax as dispatch
from moeserve.kernels.argmax import argmax_or_none_reference

NO_TOKEN = -1
INF = float("inf")


def _scores(B: int, V: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=gen) * 5


def _check(scores: torch.Tensor, device: str) -> torch.Tensor:
    from moeserve.kernels.triton_ops.argmax import argmax_or_none

    got = argmax_or_none(scores.to(device), NO_TOKEN)
    assert got.dtype == torch.int64 and got.shape == (scores.shape[0],)
    want = argmax_or_none_reference(scores, NO_TOKEN)
    assert got.cpu().tolist() == want.tolist()
    return want


def test_split():
    """At V = 102,400 a row spreads over 100 programs of 2 steps; never more than MAX_PARTS."""
    from moeserve.kernels.triton_ops.argmax import BLOCK, MAX_PARTS, split

    assert split(102_400) == (2, 100)
    assert split(129_280) == (2, 127)
    assert split(1) == (1, 1)
    for V in (1, 511, 512, 513, 65_536, 65_537, 1 << 20):
        steps, S = split(V)
        assert S <= MAX_PARTS and (S - 1) * steps * BLOCK < V <= S * steps * BLOCK


@pytest.mark.parametrize("B,V", [(1, 1), (3, 1), (9, 7), (2, 1000), (5, 5003), (4, 1537), (1, 102_400),
                                 (2, 70_001)])
def test_matches_reference(B, V, device):
    """Random rows: V of one element, under a block, several chunks, not a multiple of the block, and 2 steps
    a program (V past MAX_PARTS blocks)."""
    _check(_scores(B, V, seed=B * 1_000_003 + V), device)


def test_strided_rows(device):
    scores = _scores(6, 3000, seed=5)[:, 100:2100]
    assert scores.stride(0) == 3000
    _check(scores, device)
    _check(_scores(2100, 4, seed=6).T, device)  # columns contiguous: copied first


@pytest.mark.parametrize("V", [5003, 102_400])
def test_ties_go_to_the_lowest_index(V, device):
    """Duplicate maxima in different chunks, in one lane over two steps, and in one step's lanes; and small
    integer scores, ties everywhere."""
    scores = _scores(2, V, seed=V) - 100
    peaks = [[V - 1, V // 2, 3 * V // 4], [V - 2, 700, 520, 8] if V < 100_000 else [90_000, 517, 5, 1100]]
    for b, row in enumerate(peaks):
        scores[b, row] = 7.0
    assert _check(scores, device).tolist() == [V // 2, min(peaks[1])]
    gen = torch.Generator().manual_seed(V + 1)
    _check(torch.randint(-3, 3, (3, V), generator=gen).float(), device)


def test_bad_rows_give_no_token(device):
    """Rows with a NaN (one before a larger max), with +inf (one in the last, partial block), all -inf, -inf
    mixed with finite values, and finite only in the last entry, in one batch with a good row."""
    V = 1537
    scores = _scores(8, V, seed=17)
    scores[1, 900] = float("nan")
    scores[2, 3] = INF
    scores[3] = -INF
    scores[4, ::2] = -INF  # mixed: the max among the odd entries
    scores[5, 10] = float("nan")
    scores[5, 1500] = 1e30  # a NaN first, a larger max later: still no token
    scores[6, 1200] = -INF
    scores[6, 1536] = INF
    scores[7, :1536] = -INF  # only the last entry finite
    want = _check(scores, device)
    bad = [want[b].item() == NO_TOKEN for b in range(8)]
    assert bad == [False, True, True, True, False, True, True, False]
    assert want[7].item() == 1536 and want[4].item() % 2 == 1


def test_bad_rows_long_vocab(device):
    """NaN and +inf in a late chunk of a 2-step row, and an all -inf row, beside a good one."""
    scores = _scores(2, 102_400, seed=23)
    scores[0, 99_999] = float("nan")
    scores[1] = -INF
    assert _check(scores, device).tolist() == [NO_TOKEN, NO_TOKEN]


def test_dispatch(monkeypatch):
    """CPU tensors take the reference; CUDA float32 matrices (use_triton) the kernel, others the reference."""
    calls = []
    monkeypatch.setattr("moeserve.kernels.triton_ops.argmax.argmax_or_none",
                        lambda s, n: calls.append(s.shape) or argmax_or_none_reference(s, n))
    scores = _scores(3, 50, seed=1)
    scores[1, 4] = float("nan")
    want = argmax_or_none_reference(scores, NO_TOKEN)
    assert dispatch.argmax_or_none(scores, NO_TOKEN).tolist() == want.tolist() and want[1].item() == NO_TOKEN
    assert calls == []
    monkeypatch.setattr(dispatch, "use_triton", lambda x: True)
    assert dispatch.argmax_or_none(scores, NO_TOKEN).tolist() == want.tolist()
    dispatch.argmax_or_none(scores.double(), NO_TOKEN)
    assert calls == [(3, 50)]
