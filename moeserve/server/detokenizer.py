"""IncrementalDetokenizer: streamed token ids -> streamed text, never splitting a UTF-8 character.

The prefix-offset / read-offset method of vLLM and SGLang: each call decodes a short window of ids twice,
`ids[prefix_offset:read_offset]` (text already sent, kept as context so that decoders which depend on
neighbours, e.g. SentencePiece's leading space, render the new tokens as they would in the full text) and
`ids[prefix_offset:]`; the difference is the new text. When the window ends inside a multi-byte character
its decoding ends in U+FFFD and the text is held back until the character completes (or `flush()`).
"""

from __future__ import annotations

from typing import Protocol

_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """The text of one request's output ids, in deltas."""

    def __init__(self, tokenizer: _Decoder, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.output_ids: list[int] = []
        self.text = ""  # everything returned so far
        self.prefix_offset = 0  # start of the context window
        self.read_offset = 0  # ids before this are in self.text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int]) -> str:
        """Append ids; return the text they complete (possibly '' while a character is unfinished)."""
        self.output_ids.extend(new_ids)
        if not new_ids:
            return ""
        prefix_text = self._decode(self.output_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.output_ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            # Nothing visible yet (special tokens skipped), or a character is still incomplete.
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.output_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the request: the held-back text, incomplete characters included (as U+FFFD)."""
        if self.read_offset == len(self.output_ids):
            return ""
        prefix_text = self._decode(self.output_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.output_ids[self.prefix_offset:])
        delta = new_text[len(prefix_text):] if new_text.startswith(prefix_text) else ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.output_ids)
        self.text += delta
        return delta
