"""SamplingParams: how one request wants its tokens chosen, with SGLang's field names and defaults.

The server builds one from the request's `sampling_params` JSON object (`from_dict`), checks it early
(`validate`, with the vocabulary size once the tokenizer is known) and ships it to the scheduler; the
sampler reads it through `SamplingBatch.build` (sampler.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moeserve.constrained.base import GRAMMAR_KINDS

# Temperatures below this are greedy (argmax). Kept as given in SamplingParams; the sampler decides.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """Per-request sampling options. Names and defaults follow SGLang's `sampling_params`."""

    max_new_tokens: int = 128  # 0: the request ends with no output token (finish reason 'length')
    temperature: float = 1.0  # 0 (below GREEDY_TEMPERATURE) means greedy
    top_p: float = 1.0  # (0, 1]: smallest set of tokens whose probability reaches top_p
    top_k: int = -1  # -1 = whole vocabulary, else >= 1
    min_p: float = 0.0  # [0, 1]: drop tokens with probability < min_p * (largest probability)
    frequency_penalty: float = 0.0  # [-2, 2], subtracted once per occurrence in the output
    presence_penalty: float = 0.0  # [-2, 2], subtracted once if the token occurs in the output
    repetition_penalty: float = 1.0  # (0, 2], on tokens of prompt + output: logit / p if > 0 else logit * p
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None  # any int; the sampler reduces it modulo 2**64
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    no_stop_trim: bool = False
    # Structured outputs (at most one): the output must match a JSON schema (a string), a regex, or an EBNF grammar
    # (xgrammar's dialect); compiled by the grammar backend (moeserve/constrained/)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build from a request's JSON object; unknown keys and bad values raise ValueError.

        Values are taken as given (no None-means-default): `{"top_p": null}` is an error, not 1.0.
        The vocabulary is not known here; call `validate(vocab_size)` again once it is.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling_params must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise ValueError(
                f"unknown sampling_params key(s): {', '.join(unknown)}; supported keys: {', '.join(sorted(known))}"
            )
        params = cls(**d)
        params.validate()
        return params

    def normalized(self) -> SamplingParams:
        """A copy with list-typed fields in one form: `stop` a list of strings, `stop_token_ids` a list."""
        if self.stop is None:
            stop: list[str] = []
        elif isinstance(self.stop, str):
            stop = [self.stop]
        else:
            stop = list(self.stop)
        return dataclasses.replace(self, stop=stop, stop_token_ids=list(self.stop_token_ids or []))

    @property
    def stop_strs(self) -> list[str]:
        """`stop` as a list (empty when none)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def is_greedy(self) -> bool:
        """Whether the sampler takes the argmax: temperature ~0, or top_k == 1."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, spec) of the grammar the output must match (kind: one of GRAMMAR_KINDS), or None."""
        for kind in GRAMMAR_KINDS:
            spec = getattr(self, kind)
            if spec is not None:
                return kind, spec
        return None

    @property
    def uses_penalties(self) -> bool:
        """Whether sampling reads the tokens generated so far (frequency, presence or repetition penalty)."""
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    # ------------------------------------------------------------------ validation

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad field and its allowed range. Returns None when all are good."""
        _check_int("max_new_tokens", self.max_new_tokens, lo=0, hint="an integer >= 0")
        _check_float("temperature", self.temperature, ok=lambda x: x >= 0, hint=">= 0 (0 means greedy)")
        _check_float("top_p", self.top_p, ok=lambda x: 0 < x <= 1, hint="in (0, 1]")
        _check_int("top_k", self.top_k, hint="an integer, -1 (whole vocabulary) or >= 1")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (whole vocabulary) or >= 1, got {self.top_k}")
        _check_float("min_p", self.min_p, ok=lambda x: 0 <= x <= 1, hint="in [0, 1]")
        for name in ("frequency_penalty", "presence_penalty"):
            _check_float(name, getattr(self, name), ok=lambda x: -2 <= x <= 2, hint="in [-2, 2]")
        _check_float("repetition_penalty", self.repetition_penalty, ok=lambda x: 0 < x <= 2,
                     hint="in (0, 2] (> 0; 1 means none), as SGLang defines it")
        self._validate_stop()
        self._validate_stop_token_ids(vocab_size)
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, hint="an integer or null")
        _check_int("n", self.n, lo=1, hint="an integer >= 1")
        given = [kind for kind in GRAMMAR_KINDS if getattr(self, kind) is not None]
        for kind in given:
            if not isinstance(getattr(self, kind), str) or not getattr(self, kind):
                raise ValueError(f"{kind} must be a non-empty string, got {getattr(self, kind)!r}")
        if len(given) > 1:
            raise ValueError(f"give at most one of {', '.join(GRAMMAR_KINDS)}; got {', '.join(given)}")

    def _validate_stop(self) -> None:
        hint = "stop must be a non-empty string, a list of non-empty strings, or null"
        if self.stop is None:
            return
        items = [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(items, (list, tuple)):
            raise ValueError(f"{hint}, got {self.stop!r}")
        for s in items:
            if not isinstance(s, str) or not s:
                raise ValueError(f"{hint}, got the entry {s!r}")

    def _validate_stop_token_ids(self, vocab_size: int | None) -> None:
        if self.stop_token_ids is None:
            return
        upper = f"< vocab_size {vocab_size}" if vocab_size is not None else "a valid token id"
        hint = f"stop_token_ids must be a list of integers >= 0 and {upper}"
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"{hint}, got {self.stop_token_ids!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                raise ValueError(f"{hint}, got the entry {t!r}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_int(name: str, x: Any, lo: int | None = None, hint: str = "") -> None:
    if not _is_int(x) or (lo is not None and x < lo):
        raise ValueError(f"{name} must be {hint}, got {x!r}")


def _check_float(name: str, x: Any, ok: Any, hint: str) -> None:
    # ints are fine (JSON `1` for temperature); bools and NaN/inf are not.
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or not ok(x):
        raise ValueError(f"{name} must be a number {hint}, got {x!r}")
