"""RequestValidator: a request's prompt as token ids and its sampling parameters, checked against the model's limits.

Nothing here may stall the server process's event loop, whatever the client sends:
- a text prompt longer than the longest one that could fit the context (context length x the longest token, in
  characters: every token stands for at most that many bytes, every character for at least one) is refused from
  its length alone, before it is tokenized;
- a long text is tokenized in a worker thread, by the tokenizer's batch call, which releases the GIL;
- a long list of token ids is checked in a worker thread (a Python loop, which lets the event loop run).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from moeserve.constrained.base import GrammarBackend, GrammarError, NoGrammarBackend
from moeserve.rank.sampling_params import SamplingParams
from moeserve.text.tokenizer import Tokenizer

INLINE_TEXT_CHARS = 8192  # shorter texts are tokenized on the event loop (well under a millisecond)
INLINE_IDS = 65536  # shorter id lists are checked on the event loop
MAX_TOP_LOGPROBS = 20

T = TypeVar("T")


class InvalidRequestError(ValueError):
    """The request is malformed or cannot be served (the HTTP layer answers 400, with `code` and `param`)."""

    def __init__(self, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param


def check_fits_context(prompt_len: int, max_new_tokens: int, context_length: int) -> None:
    """Refuse a request whose max_new_tokens leaves the context (the prompt itself fits: check_prompt_len); the
    error names max_new_tokens, the field to change (the OpenAI routes say max_tokens)."""
    if prompt_len + max_new_tokens > context_length:
        raise InvalidRequestError(
            f"max_new_tokens {max_new_tokens} does not fit the context: the prompt has {prompt_len} tokens and the "
            f"context length is {context_length}, which leaves room for at most {context_length - prompt_len} new "
            "tokens", code="context_length_exceeded", param="max_new_tokens")


class RequestFailedError(RuntimeError):
    """The engine could not finish a request it had taken (e.g. the model's logits were not finite): the HTTP
    layer answers `status`."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


class RequestValidator:
    """Turns a request's prompt into token ids and its sampling_params into SamplingParams, or says what is wrong."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, context_length: int, max_total_tokens: int,
                 grammar: GrammarBackend | None = None):
        self.tokenizer = tokenizer
        self.grammar = grammar if grammar is not None else NoGrammarBackend("the server has no grammar backend")
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.max_total_tokens = max_total_tokens
        # Longest text that could tokenize to a prompt that fits (see the module docstring).
        self.max_prompt_chars = (context_length * tokenizer.max_token_bytes if tokenizer is not None else 0)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="moeserve-tokenize")

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in one of the validator's worker threads."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ prompt
    async def prompt_ids(self, text: str | None, input_ids: list[int] | None) -> list[int]:
        """The prompt's token ids: `input_ids` checked against the vocabulary, or `text` tokenized."""
        if input_ids is not None:
            if text is not None:
                raise InvalidRequestError("give either text or input_ids, not both")
            if not isinstance(input_ids, list):
                raise InvalidRequestError("input_ids must be a list of integers")
            self.check_prompt_len(len(input_ids))
            if len(input_ids) > INLINE_IDS:
                await self.off_loop(self.check_ids, input_ids)
            else:
                self.check_ids(input_ids)
            return input_ids
        if text is None:
            raise InvalidRequestError("give text or input_ids")
        if not isinstance(text, str):
            raise InvalidRequestError("text must be a string")
        if not text:
            raise InvalidRequestError("the prompt is empty")
        if self.tokenizer is None:
            raise InvalidRequestError("the server runs without a tokenizer (--skip-tokenizer-init): send input_ids")
        self.check_text_len(len(text))
        ids = self.tokenizer.encode(text) if len(text) <= INLINE_TEXT_CHARS else await self.off_loop(
            self.tokenizer.encode, text)
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        return ids

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text the server made (a rendered chat), off the event loop when it is long."""
        assert self.tokenizer is not None
        self.check_text_len(len(text))
        if len(text) <= INLINE_TEXT_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await self.off_loop(self.tokenizer.encode, text, add_special_tokens)

    def check_text_len(self, num_chars: int, what: str = "the prompt") -> None:
        """Refuse a text too long to fit the context, from its length alone (before tokenizing or rendering)."""
        if num_chars > self.max_prompt_chars:
            raise InvalidRequestError(
                f"{what} is longer than the context length of {self.context_length} tokens allows: its {num_chars} "
                f"characters are more than {self.context_length} tokens can spell; it was not tokenized",
                code="context_length_exceeded")

    def check_prompt_len(self, num_tokens: int) -> None:
        if num_tokens >= self.context_length:
            raise InvalidRequestError(f"the prompt has {num_tokens} tokens, but the context length is "
                                      f"{self.context_length}", code="context_length_exceeded")

    def check_ids(self, ids: list[int]) -> None:
        if not all(type(t) is int for t in ids):  # noqa: E721 - bool is not a token id
            raise InvalidRequestError("input_ids must be a list of integers")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"input_ids has token ids outside the vocabulary [0, {self.vocab_size}): "
                                      f"{bad[:5]}")
        if not ids:
            raise InvalidRequestError("the prompt is empty")

    # ------------------------------------------------------------------ sampling
    def params(self, sampling_params: dict | None, prompt_len: int, top_logprobs_num: Any = 0) -> SamplingParams:
        """SamplingParams of a request whose prompt has `prompt_len` tokens, checked against the context and KV."""
        try:
            params = SamplingParams.from_dict(sampling_params or {})
            params.validate(self.vocab_size)
        except (TypeError, ValueError) as e:
            raise InvalidRequestError(str(e)) from None
        self.check_prompt_len(prompt_len)
        check_fits_context(prompt_len, params.max_new_tokens, self.context_length)
        if prompt_len + params.max_new_tokens > self.max_total_tokens:
            raise InvalidRequestError(
                f"prompt + max_new_tokens = {prompt_len + params.max_new_tokens} tokens exceeds the KV cache "
                f"({self.max_total_tokens} tokens)")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; use stop_token_ids")
        if type(top_logprobs_num) is not int or not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs_num must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        return params

    async def check_grammar(self, grammar: tuple[str, str] | None) -> None:
        """Compile a request's grammar (SamplingParams.grammar: kind, spec), if any, once per distinct spec and off
        the event loop, so that a bad schema, regex or grammar is the client's 400 here, not a failure on the ranks."""
        if grammar is None:
            return
        kind, spec = grammar
        try:
            await self.off_loop(self.grammar.compile, kind, spec)
        except GrammarError as e:
            raise InvalidRequestError(str(e), param=kind) from None
