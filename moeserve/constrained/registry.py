"""Grammar backends by name: --grammar-backend's choices (SGLang's flag)."""

from __future__ import annotations

from collections.abc import Callable

from moeserve.constrained.base import GrammarBackend, NoGrammarBackend, VocabSource


def _xgrammar(tokenizer: VocabSource, vocab_size: int) -> GrammarBackend:
    from moeserve.constrained.xgrammar_backend import XGrammarBackend  # imports xgrammar only when it runs

    return XGrammarBackend(tokenizer, vocab_size)


GRAMMAR_BACKENDS: dict[str, Callable[[VocabSource, int], GrammarBackend]] = {
    "xgrammar": _xgrammar,
    "none": lambda tokenizer, vocab_size: NoGrammarBackend(),
}


def make_grammar_backend(name: str, tokenizer: VocabSource | None, vocab_size: int) -> GrammarBackend:
    """The backend `name` over the model's vocabulary (vocab_size: the logits' width)."""
    if name not in GRAMMAR_BACKENDS:
        raise ValueError(f"unknown grammar backend {name!r}; choose {', '.join(GRAMMAR_BACKENDS)}")
    if tokenizer is None and name != "none":
        return NoGrammarBackend("the server runs without a tokenizer (--skip-tokenizer-init)")
    return GRAMMAR_BACKENDS[name](tokenizer, vocab_size)
