"""The shipped default model's held-out text, cut into the windows that its perplexity is measured on.

The training script, the perplexity test and docs/default_model.md all score the same windows: each is the
beginning-of-sentence token followed by WINDOW - 1 tokens of held-out text (files of Python's standard library
that training never saw, see scripts/train_default_model.py), and a window's perplexity counts every token after
the first. Scoring token ids, not text, keeps a detokenize-retokenize round trip out of the number.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from moeserve.models.default_model import BOS_TOKEN, SHIPPED_DIR

WINDOW = 256  # tokens per scored window, BOS included


def heldout_windows(token_ids: Sequence[int], bos_id: int, window: int = WINDOW) -> list[list[int]]:
    """Non-overlapping windows [bos_id] + token_ids[i : i + window - 1]; a short tail is dropped."""
    step = window - 1
    return [[bos_id, *token_ids[i:i + step]] for i in range(0, len(token_ids) - step + 1, step)]


def perplexity(token_logprobs: Sequence[Sequence[float]]) -> float:
    """exp of the mean negative log-probability over every scored token of every window."""
    flat = [lp for window in token_logprobs for lp in window]
    if not flat:
        raise ValueError("no token log-probabilities to score")
    return math.exp(-sum(flat) / len(flat))


def shipped_windows(model_dir: Path = SHIPPED_DIR) -> list[list[int]]:
    """The windows of the shipped heldout.txt, tokenized with the shipped tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tok.encode((model_dir / "heldout.txt").read_text(encoding="utf-8"), add_special_tokens=False).ids
    return heldout_windows(ids, tok.token_to_id(BOS_TOKEN))
