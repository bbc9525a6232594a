"""Tokenizer: a Hugging Face tokenizer directory read without transformers.

`load_tokenizer(path)` reads tokenizer.json with the `tokenizers` library and tokenizer_config.json (special
tokens, add_bos_token, chat_template; also chat_template.jinja and generation_config.json's eos ids when
present) and renders chat templates with jinja2 the way transformers does, so that encode, decode and
apply_chat_template agree with `transformers.AutoTokenizer` on the same files.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

_GIL_FREE_IDS = 2048  # id lists longer than this are decoded without holding the GIL (Tokenizer.decode)
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class Tokenizer:
    """Encode, decode and chat templates of one model; the server's only view of the tokenizer."""

    def __init__(self, backend: HFTokenizer, config: dict[str, Any], chat_template: str | None = None,
                 extra_eos_token_ids: list[int] | None = None, name_or_path: str = ""):
        self.backend = backend
        self.name_or_path = name_or_path
        self.chat_template = chat_template
        self.special_tokens: dict[str, str] = {}  # bos_token -> "<s>", ...: what templates see
        for name in _SPECIAL_NAMES:
            content = _token_content(config.get(name))
            if content is not None:
                self.special_tokens[name] = content
        self.bos_token_id: int | None = self._token_id(self.special_tokens.get("bos_token"))
        self.eos_token_id: int | None = self._token_id(self.special_tokens.get("eos_token"))
        self.pad_token_id: int | None = self._token_id(self.special_tokens.get("pad_token"))
        eos = [self.eos_token_id] if self.eos_token_id is not None else []
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos + list(extra_eos_token_ids or [])))
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

        special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        special |= {i for i in (self._token_id(t) for t in self.special_tokens.values()) if i is not None}
        self.all_special_ids: list[int] = sorted(special)
        self._special_set = frozenset(special) | frozenset(backend.get_added_tokens_decoder())
        self._byte_level = type(backend.decoder).__name__ == "ByteLevel"
        self._max_token_bytes: int | None = None

        # BOS: tokenizer.json's post-processor usually adds it; add_bos_token in the config decides, as the
        # transformers Llama-style tokenizers do by rewriting the post-processor.
        probe = backend.encode("a", add_special_tokens=True).ids
        self._post_adds_bos = self.bos_token_id is not None and bool(probe) and probe[0] == self.bos_token_id
        add_bos = config.get("add_bos_token")
        self._prepend_bos = bool(add_bos) and self.bos_token_id is not None and not self._post_adds_bos
        self._strip_bos = add_bos is False and self._post_adds_bos

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    # ------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, BOS (and whatever the post-processor adds).

        Through `encode_batch_fast`: the same pipeline and ids without the character offsets (a third less time: a
        1,100-token text 0.64 against 0.95 ms), and as a batch call it releases the GIL while it tokenizes (the
        single call holds it: a 1 MB text stalled every other thread of the process for most of a second).
        """
        ids = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens:
            if self._prepend_bos:
                ids = [self.bos_token_id, *ids]
            elif self._strip_bos and ids and ids[0] == self.bos_token_id:
                ids = ids[1:]
        return ids

    @property
    def max_token_bytes(self) -> int:
        """The most bytes any one token stands for (so a text of n bytes has at least n / this many tokens)."""
        if self._max_token_bytes is None:
            size = self.backend.get_vocab_size(with_added_tokens=True)
            self._max_token_bytes = max((len(self.token_bytes(i)) for i in range(size)), default=1) or 1
        return self._max_token_bytes

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(ids) > _GIL_FREE_IDS:  # the batch call releases the GIL (see encode)
            return self.backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level token may hold part of a UTF-8 character)."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and token_id not in self._special_set:
            decoder = _byte_decoder()
            if all(ch in decoder for ch in piece):
                return bytes(decoder[ch] for ch in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def decoded_vocab(self) -> list[bytes]:
        """Every token's bytes by id, b"" for the special tokens (they write no text): a grammar engine's view."""
        special = set(self.all_special_ids)
        return [b"" if i in special else self.token_bytes(i) for i in range(self.vocab_size)]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **template_kwargs: Any) -> str:
        """The prompt text of a conversation, rendered like transformers' apply_chat_template
        (`tools`, OpenAI's tool objects, among the template variables).

        continue_final_message: the text ends inside the last message (the model continues it), as transformers'
        flag of that name does; it excludes add_generation_prompt.
        Raises ValueError when the model has no chat template or the template rejects the conversation.
        """
        if continue_final_message:
            return self._continue_final(messages, **template_kwargs)
        if not self.chat_template:
            raise ValueError(
                f"the model's tokenizer ({self.name_or_path or 'unnamed'}) has no chat template; "
                "use /v1/completions or /generate with a plain prompt instead"
            )
        import jinja2

        template = _compile_template(self.chat_template)
        try:
            return template.render(messages=messages, **({"tools": None, "documents": None} | template_kwargs),
                                   add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e

    def _continue_final(self, messages: list[dict], **template_kwargs: Any) -> str:
        # Templates close every message (an end-of-turn token); to continue the last one, render the conversation
        # closed and cut right after that message's own text, found from the end (its text may occur earlier).
        final = messages[-1].get("content") if messages else None
        if not isinstance(final, str) or not final.strip():
            raise ValueError("continue_final_message needs a last message with text to continue")
        rendered = self.apply_chat_template(messages, add_generation_prompt=False, **template_kwargs)
        core = final.strip()
        at = rendered.rfind(core)
        if at < 0:
            raise ValueError("continue_final_message: the chat template does not write the last message's text")
        # Keep the message's trailing whitespace when the template kept it too.
        kept = final.lstrip()
        end = at + (len(kept) if rendered.startswith(kept, at) else len(core))
        return rendered[:end]

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, eos={self.eos_token_ids})"


# ----------------------------------------------------------------------
def load_tokenizer(path: str) -> Tokenizer:
    """Load a tokenizer from a directory holding tokenizer.json (+ tokenizer_config.json)."""
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
        raise FileNotFoundError(
            f"no tokenizer.json in {path!r}: moeserve reads fast-tokenizer files only; save the tokenizer "
            "with transformers' save_pretrained to produce one, or pass --skip-tokenizer-init"
        )
    backend = HFTokenizer.from_file(tok_file)
    config = _read_json(os.path.join(path, "tokenizer_config.json")) or {}

    # Special tokens missing from tokenizer_config.json may be in special_tokens_map.json (older saves).
    special_map = _read_json(os.path.join(path, "special_tokens_map.json")) or {}
    for name in _SPECIAL_NAMES:
        if config.get(name) is None and special_map.get(name) is not None:
            config[name] = special_map[name]

    chat_template = config.get("chat_template")
    if isinstance(chat_template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
        chat_template = named.get("default") or next(iter(named.values()), None)
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):  # transformers v5 saves the template beside the config
        with open(jinja_file, encoding="utf-8") as f:
            chat_template = f.read()

    extra_eos: list[int] = []
    gen_config = _read_json(os.path.join(path, "generation_config.json")) or {}
    eos = gen_config.get("eos_token_id")
    if isinstance(eos, int):
        extra_eos = [eos]
    elif isinstance(eos, list):
        extra_eos = [int(e) for e in eos]
    return Tokenizer(backend, config, chat_template, extra_eos, name_or_path=path)


def _read_json(file: str) -> dict | None:
    if not os.path.isfile(file):
        return None
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: the character byte-level BPE uses for each byte -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


@lru_cache(maxsize=16)
def _compile_template(source: str):
    """A jinja2 template in the sandboxed environment transformers uses for chat templates."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters; transformers overrides it the same way.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class GenerationBlock(jinja2.ext.Extension):
        # Training templates mark assistant text with {% generation %}...{% endgeneration %}; render it as is.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)
