"""IncrementalDetokenizer: streamed deltas add up to the full decode and never split a UTF-8 character."""

from __future__ import annotations

import random

import pytest

from moeserve.models.default_model import default_model_path
from moeserve.server.detokenizer import IncrementalDetokenizer
from moeserve.text.tokenizer import load_tokenizer

TEXTS = [
    "日本語のテキストと中文字符が混ざっています。",
    "emoji 😀🚀👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵",
    "café naïve Ångström déjà vu — “quotes” ‘single’ …",
    "The Tortoise and the Hare. Slow and steady wins the race.",
    "mixed 中 a 😀 b é c 한국어 d",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())


def _stream(tok, ids: list[int], chunk_sizes: list[int], skip_special_tokens: bool = True) -> None:
    """Feed ids in chunks; check the invariants at every step and at the end."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    deltas: list[str] = []
    pos = 0
    for size in chunk_sizes:
        chunk = ids[pos:pos + size]
        pos += len(chunk)
        deltas.append(detok.add(chunk))
        full = tok.decode(ids[:pos], skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == detok.text
        assert full.startswith(detok.text)
        if not full.endswith("\ufffd"):
            assert detok.text == full, (ids[:pos], detok.text, full)
        # Held-back text is only the unfinished character at the end.
        assert "\ufffd" not in detok.text or "\ufffd" in full[: len(detok.text)]
        assert detok.output_ids == ids[:pos]
        if pos == len(ids):
            break
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert detok.flush() == ""


@pytest.mark.parametrize("text", TEXTS)
def test_real_text_one_token_at_a_time(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    if not text.isascii():
        # The default tokenizer never saw CJK or emoji: their characters are split over byte tokens.
        assert any(tok.decode([i]).endswith("\ufffd") for i in ids)
    _stream(tok, ids, [1] * len(ids))


def test_split_characters_are_held_back(tok):
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) == 4  # one byte token each
    detok = IncrementalDetokenizer(tok)
    assert [detok.add([i]) for i in ids] == ["", "", "", "😀"]
    assert detok.flush() == ""


@pytest.mark.parametrize("seed", range(20))
def test_random_chunks_of_real_text(tok, seed):
    rng = random.Random(seed)
    text = " ".join(rng.choice(TEXTS) for _ in range(3))
    ids = tok.encode(text, add_special_tokens=rng.random() < 0.5)
    sizes = [rng.randint(0, 4) for _ in range(len(ids) * 2)]
    _stream(tok, ids, sizes + [len(ids)], skip_special_tokens=rng.random() < 0.7)


@pytest.mark.parametrize("seed", range(20))
def test_random_ids_with_invalid_utf8(tok, seed):
    """Arbitrary ids (stray continuation bytes, truncated characters, special tokens) still add up."""
    rng = random.Random(seed)
    ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 60))]
    _stream(tok, ids, [rng.randint(1, 3) for _ in range(len(ids))] + [len(ids)],
            skip_special_tokens=rng.random() < 0.5)


def test_truncated_character_is_flushed(tok):
    ids = tok.encode("ab日", add_special_tokens=False)[:-1]  # the last byte of 日 never comes
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[:1]) == "ab"
    assert detok.add(ids[1:]) == ""
    assert detok.flush() == "\ufffd"
    assert detok.text == tok.decode(ids)


def test_special_tokens(tok):
    ids = tok.encode("hi", add_special_tokens=True) + tok.eos_token_ids
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    assert "".join(detok.add([i]) for i in ids) + detok.flush() == "hi"
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(detok.add([i]) for i in ids) + detok.flush() == "<｜begin▁of▁sentence｜>hi<｜end▁of▁sentence｜>"


def test_metaspace_tokenizer_keeps_word_spaces():
    """A SentencePiece-style decoder drops the leading space of a decode: the context window keeps it."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from moeserve.text.tokenizer import Tokenizer

    backend = HFTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"] +
                                  [f"<0x{b:02X}>" for b in range(256)], show_progress=False)
    backend.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 3, trainer=trainer)
    tok = Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>"})
    for text in ["hello world the fox", "the lazy dog jumps", "hello 日本 world"]:
        ids = tok.encode(text, add_special_tokens=False)
        _stream(tok, ids, [1] * len(ids))
