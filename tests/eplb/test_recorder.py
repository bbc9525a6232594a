"""The recorder's rings on synthetic routing: per_pass keeps the newest `buffer_size` passes of a window, per_token
the newest `buffer_size` tokens, each exactly as routed."""

from __future__ import annotations

import torch

from moeserve.eplb.recorder import ExpertDistributionRecorder, merge_dumps

LAYERS, EXPERTS, K = (3, 5), 8, 2


def _feed(rec: ExpertDistributionRecorder, passes: list[torch.Tensor]) -> None:
    """Each pass: topk_ids [T, layers, k], reported layer by layer, then the pass ends."""
    for ids in passes:
        for i, layer in enumerate(LAYERS):
            rec.on_select_experts(layer, ids[:, i])
        rec.on_pass_end(ids.shape[0])


def _passes(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, EXPERTS, (int(torch.randint(0, 6, (1,), generator=g)), len(LAYERS), K), generator=g)
            for _ in range(n)]


def _counts(ids: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.bincount(ids[:, i].reshape(-1), minlength=EXPERTS) for i in range(len(LAYERS))])


def test_per_pass_ring_keeps_the_newest_passes_of_the_window():
    rec = ExpertDistributionRecorder(LAYERS, EXPERTS, "cpu", "per_pass", buffer_size=4)
    before, window = _passes(3, 0), _passes(6, 1)
    _feed(rec, before)
    rec.start()
    _feed(rec, window)
    dump = rec.dump()
    assert dump["forward_pass_id"].tolist() == [5, 6, 7, 8]  # passes 3..8 are the window; the ring holds 4
    assert torch.equal(dump["logical_count"], torch.stack([_counts(p) for p in window[-4:]]))
    rec.stop()
    _feed(rec, _passes(2, 2))  # after the window: not in it, and they push its oldest passes out of the ring
    assert rec.dump()["forward_pass_id"].tolist() == [7, 8]
    assert torch.equal(rec.window(), sum(_counts(p) for p in window))  # the window's total is kept whole


def test_per_token_ring_keeps_the_newest_tokens_in_order():
    rec = ExpertDistributionRecorder(LAYERS, EXPERTS, "cpu", "per_token", buffer_size=7, top_k=K,
                                     max_rows_per_pass=8)
    rec.start()
    window = _passes(5, 3)
    _feed(rec, window)
    dump = rec.dump()
    tokens = torch.cat(window)
    pass_of = torch.cat([torch.full((p.shape[0],), i) for i, p in enumerate(window)])
    assert torch.equal(dump["topk_ids"], tokens[-7:]) and torch.equal(dump["forward_pass_id"], pass_of[-7:])
    assert torch.equal(dump["logical_count"][0], _counts(tokens))


def test_merge_sums_counts_and_joins_tokens():
    parts = []
    for seed in (4, 5):
        rec = ExpertDistributionRecorder(LAYERS, EXPERTS, "cpu", "per_token", buffer_size=100, top_k=K,
                                         max_rows_per_pass=8)
        rec.start()
        _feed(rec, _passes(3, seed))
        parts.append(rec.dump())
    merged = merge_dumps(parts, "per_token")
    assert torch.equal(merged["logical_count"], parts[0]["logical_count"] + parts[1]["logical_count"])
    assert merged["topk_ids"].shape[0] == parts[0]["topk_ids"].shape[0] + parts[1]["topk_ids"].shape[0]
