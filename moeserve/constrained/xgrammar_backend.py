"""xgrammar (SGLang's default grammar engine): JSON schemas, regexes and EBNF grammars (xgrammar's GBNF dialect)
compiled against the model's vocabulary; the token mask is xgrammar's packed bitmask and its kernel (C++ on the
CPU, Triton on CUDA)."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from moeserve.constrained.base import GrammarBackend, GrammarError, GrammarMatcher, TokenMask, VocabSource

_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[00:04:30] /project/cpp/regex_converter.cc:94: "


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: VocabSource, vocab_size: int) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width: the model's vocabulary, perhaps padded past the tokenizer's
        self._compiler: Any = None  # made on first use: xgrammar's import takes half a second, the vocab a moment

    def _xgr(self) -> Any:
        import xgrammar

        if self._compiler is None:
            # token ids past the tokenizer's vocabulary (the model's padding) are never allowed
            info = xgrammar.TokenizerInfo(self.tokenizer.decoded_vocab()[:self.vocab_size], xgrammar.VocabType.RAW,
                                          vocab_size=self.vocab_size, stop_token_ids=self.tokenizer.eos_token_ids)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1))
        return xgrammar

    def _compile(self, kind: str, spec: str) -> Any:
        self._xgr()
        if not isinstance(spec, str):
            raise GrammarError(f"{kind} must be a string, got {type(spec).__name__}")
        try:
            if kind == "json_schema":
                try:
                    json.loads(spec)
                except ValueError as e:
                    raise GrammarError(f"json_schema is not valid JSON: {e}") from None
                # one line, as json.dumps writes it: free whitespace lets a model pad forever instead of ending
                return self._compiler.compile_json_schema(spec, any_whitespace=False)
            if kind == "regex":
                return self._compiler.compile_regex(spec)
            return self._compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            if isinstance(e, GrammarError):
                raise
            raise GrammarError(f"invalid {kind}: {_CPP_PREFIX.sub('', str(e)).strip()}") from None

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return self._xgr().GrammarMatcher(compiled)

    def token_mask(self, matchers: list[GrammarMatcher | None], device: torch.device) -> TokenMask | None:
        rows = [b for b, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        xgr = self._xgr()
        # rows that are not constrained are never read (the kernel takes `rows`): no need to fill them
        bitmask = torch.empty(xgr.get_bitmask_shape(len(matchers), self.vocab_size), dtype=torch.int32,
                              pin_memory=device.type == "cuda")
        for b in rows:
            matchers[b].fill_next_token_bitmask(bitmask, b)
        return TokenMask(bitmask.to(device, non_blocking=True), rows, _apply_inplace)


def _apply_inplace(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
