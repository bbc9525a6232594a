"""moeserve.text.tokenizer against transformers' AutoTokenizer on the same files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from moeserve.models.default_model import default_model_path
from moeserve.text.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world, this is a test.",
    "  two leading spaces and trailing  ",
    "café naïve Ångström déjà vu",
    "日本語のテキストと中文字符",
    "emoji 😀🚀👍🏽 and a family 👨‍👩‍👧",
    "def add(a, b):\n    return a + b\n",
    "numbers 3.14159 2024 -1 +1 50% $20",
    "special tokens in text <｜User｜>hi<｜Assistant｜>there<｜end▁of▁sentence｜>",
    "",
    "\n\n\t tabs and newlines \r\n",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "A"},
        {"role": "system", "content": "B"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there"},
        {"role": "user", "content": "日本語 😀"},
    ],
]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def hf(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def test_attributes(tok, hf):
    assert tok.bos_token_id == hf.bos_token_id == 0
    assert tok.eos_token_ids == [hf.eos_token_id] == [1]
    assert tok.vocab_size == len(hf) == 3072
    assert set(hf.all_special_ids) <= set(tok.all_special_ids)
    assert {tok.backend.token_to_id("<｜User｜>"), tok.backend.token_to_id("<｜Assistant｜>")} <= set(tok.all_special_ids)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok, hf, text):
    for add_special in (True, False):
        ids = tok.encode(text, add_special_tokens=add_special)
        assert ids == hf.encode(text, add_special_tokens=add_special)
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text.replace("<｜User｜>", "").replace(
        "<｜Assistant｜>", "").replace("<｜end▁of▁sentence｜>", "")


def test_corpus_lines_round_trip(tok, hf):
    corpus = (Path(__file__).parents[2] / "moeserve" / "models" / "default_corpus.txt").read_text(encoding="utf-8")
    for line in corpus.splitlines():
        ids = tok.encode(line)
        assert ids == hf.encode(line)
        assert tok.decode(ids) == line


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf, messages, add_generation_prompt):
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert ours.startswith("<｜begin▁of▁sentence｜>")
    assert ours.endswith("<｜Assistant｜>") == add_generation_prompt
    # Chat prompts carry BOS in the text: tokenized without adding another, as transformers does.
    assert tok.encode(ours, add_special_tokens=False) == hf.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False)


def test_chat_template_raise_exception_is_value_error(tok):
    with pytest.raises(ValueError, match="unsupported message role: function"):
        tok.apply_chat_template([{"role": "function", "content": "x"}])


def _copy_model(model_dir: str, tmp_path: Path) -> Path:
    out = tmp_path / "tok"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(model_dir) / name, out / name)
    return out


def test_no_chat_template_raises(model_dir, tmp_path):
    out = _copy_model(model_dir, tmp_path)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(str(out))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_forms_and_generation_config(model_dir, tmp_path):
    out = _copy_model(model_dir, tmp_path)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    # A list of named templates, then a chat_template.jinja file, which wins (transformers v5 layout).
    cfg["chat_template"] = [{"name": "other", "template": "X"}, {"name": "default", "template": "D{{ bos_token }}"}]
    cfg["bos_token"] = {"content": cfg["bos_token"], "__type": "AddedToken"}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_tokenizer(str(out)).apply_chat_template([]) == "D<｜begin▁of▁sentence｜>"
    (out / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}")
    assert load_tokenizer(str(out)).apply_chat_template([{"role": "user", "content": "é<"}]) == '"é<"'
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    assert load_tokenizer(str(out)).eos_token_ids == [1, 3]


def test_add_bos_token_false_strips_post_processor_bos(model_dir, tmp_path):
    out = _copy_model(model_dir, tmp_path)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = False
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(str(out))
    assert tok.encode("hello") == tok.encode("hello", add_special_tokens=False)


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_token_bytes(tok):
    ids = tok.encode("a 日本 😀 é", add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == "a 日本 😀 é".encode()
    assert tok.token_bytes(tok.bos_token_id) == "<｜begin▁of▁sentence｜>".encode()
    assert all(tok.token_bytes(i) == tok.decode([i]).encode() for i in range(5, tok.vocab_size)
               if "\ufffd" not in tok.decode([i]))


@pytest.mark.parametrize("last", ["The answer is", "  padded reply \n", "<｜User｜> repeated"])
def test_continue_final_message_matches_transformers(tok, hf, last):
    # The last message's text also occurs earlier in the conversation: the cut is after its last occurrence.
    messages = [{"role": "user", "content": last.strip()}, {"role": "assistant", "content": last}]
    ours = tok.apply_chat_template(messages, continue_final_message=True)
    theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                    continue_final_message=True)
    assert ours == theirs
    assert not ours.endswith("<｜end▁of▁sentence｜>")
    with pytest.raises(ValueError, match="continue_final_message"):
        tok.apply_chat_template([{"role": "assistant", "content": " "}], continue_final_message=True)
