"""The grammar backend protocol: compile a spec once, match one request's tokens against it, mask the logits.

A request asks for at most one of GRAMMAR_KINDS (SGLang's sampling parameters of those names). The server compiles
it at admission (a bad spec is the client's error: GrammarError, HTTP 400); the rank compiles it again from the
same cache-backed call and gives the request a GrammarMatcher. Each step, the constrained rows' allowed tokens are
packed into a bitmask (TokenMask) that the sampler applies to those rows only; the sampled token goes back to the
matcher (accept_token), and a terminated matcher (it accepted a stop token) ends the request.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")  # the sampling parameters that ask for a grammar
COMPILE_CACHE_SIZE = 256  # distinct specs kept compiled


class GrammarError(ValueError):
    """A spec the backend cannot compile (the client's error), or a server that compiles no grammar."""


class VocabSource(Protocol):
    """What a grammar engine needs of the tokenizer (this room knows no tokenizer class; text/tokenizer.py's is one)."""

    eos_token_ids: list[int]  # the tokens that end a matched grammar

    def decoded_vocab(self) -> list[bytes]: ...  # [tokenizer vocab] each token's text; b"" for special tokens


class GrammarMatcher(Protocol):
    """One request's place in its grammar."""

    def accept_token(self, token_id: int) -> bool: ...  # False: the grammar does not allow it (nothing changes)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...  # row of [B, ceil(V/32)]

    def is_terminated(self) -> bool: ...  # a stop token was accepted: nothing more may come

    def rollback(self, num_tokens: int) -> None: ...  # forget the last accepted tokens


@dataclass
class TokenMask:
    """One step's grammar constraint for the sampler: rows `rows` of the logits may take only the bitmask's tokens."""

    bitmask: torch.Tensor  # [B, ceil(V/32)] int32 on the logits' device: bit v of row b set = token v allowed
    rows: list[int]  # the constrained rows; the others are left untouched
    apply_inplace: Callable[[torch.Tensor, torch.Tensor, list[int]], None]  # (logits [B, V], bitmask, rows)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of logits [B, V] float32 with the disallowed tokens of the constrained rows at -inf."""
        masked = logits.clone()
        self.apply_inplace(masked, self.bitmask, self.rows)
        return masked


class GrammarBackend(ABC):
    """Compiles specs (cached by (kind, spec)) and makes matchers and token masks."""

    name: str

    def __init__(self) -> None:
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()  # the server compiles in worker threads

    def compile(self, kind: str, spec: str) -> Any:
        """The compiled grammar of `spec`, one of GRAMMAR_KINDS; GrammarError when it is not valid."""
        assert kind in GRAMMAR_KINDS, kind
        key = (kind, spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            compiled = self._compile(kind, spec)
            self._cache[key] = compiled
            if len(self._cache) > COMPILE_CACHE_SIZE:
                self._cache.popitem(last=False)
            return compiled

    @abstractmethod
    def _compile(self, kind: str, spec: str) -> Any: ...

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher: ...

    @abstractmethod
    def token_mask(self, matchers: list[GrammarMatcher | None], device: torch.device) -> TokenMask | None:
        """The mask of a step whose rows have these matchers (None: a free row); None when no row is constrained."""


class NoGrammarBackend(GrammarBackend):
    """--grammar-backend none (or a server without a tokenizer): every constrained request is refused."""

    name = "none"

    def __init__(self, why: str = "the server runs with --grammar-backend none") -> None:
        super().__init__()
        self.why = why

    def _compile(self, kind: str, spec: str) -> Any:
        raise GrammarError(f"{kind} is not supported: {self.why}")

    def matcher(self, compiled: Any) -> GrammarMatcher:
        raise AssertionError("nothing compiles without a grammar backend")

    def token_mask(self, matchers: list[GrammarMatcher | None], device: torch.device) -> TokenMask | None:
        return None
