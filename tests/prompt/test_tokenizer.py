"""`load_tokenizer`: every accepted form encodes timestamp text the same, without special tokens,
once per distinct string; missing or unusable tokenizers fail clearly."""

from __future__ import annotations

import sys

import pytest

from mmferry.prompt.tokenizer import CachedTokenizer, TimestampTokenizer, load_tokenizer

TEXT = "<12.5 seconds>"
IDS = [1, 11, 12, 3, 15, 4, 2]  # "<" 1 2 "." 5 "seconds" ">" in the test vocabulary


def _with_bos(tokenizer_json):
    """The test tokenizer with a post-processor that adds a BOS token, as many checkpoints do."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.post_processor = processors.TemplateProcessing(
        single="[UNK] $A", special_tokens=[("[UNK]", 0)]
    )
    assert tok.encode(TEXT).ids == [0, *IDS]
    return tok


def test_every_form_gives_the_same_ids(tokenizer_json, hf_tokenizer):
    forms = [
        tokenizer_json,
        str(tokenizer_json),
        tokenizer_json.parent,  # a checkpoint folder
        _with_bos(tokenizer_json),  # tokenizers.Tokenizer: special tokens must stay out
        hf_tokenizer,  # transformers tokenizer
    ]
    for form in forms:
        tok = load_tokenizer(form)
        assert isinstance(tok, TimestampTokenizer)
        assert tok.encode(TEXT) == IDS, form


def test_plain_encode_object_and_idempotence():
    class Chars:
        def encode(self, text: str) -> list[int]:
            return [ord(c) for c in text]

    tok = load_tokenizer(Chars())
    assert tok.encode("<1>") == [60, 49, 62]
    assert load_tokenizer(tok) is tok


def test_each_distinct_string_is_encoded_once():
    calls: list[str] = []

    class Counting:
        def encode(self, text: str) -> list[int]:
            calls.append(text)
            return [len(text)]

    tok = load_tokenizer(Counting())
    for _ in range(3):
        assert tok.encode("<0.3 seconds>") == [13]
        assert tok.encode("<1.3 seconds>") == [13]
    assert calls == ["<0.3 seconds>", "<1.3 seconds>"]
    # Callers get their own list; the cache cannot be mutated through it.
    tok.encode("<0.3 seconds>").append(99)
    assert tok.encode_cached("<0.3 seconds>") == (13,)


def test_missing_tokenizer_is_a_clear_error():
    with pytest.raises(ValueError, match="Qwen3-VL video prompts need the checkpoint's tokenizer"):
        load_tokenizer(None)
    with pytest.raises(TypeError, match="no encode"):
        load_tokenizer(42)


def test_missing_file_and_missing_package(tmp_path, tokenizer_json, monkeypatch):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)  # a folder without one
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'mmferry\[tokenizer\]'"):
        load_tokenizer(tokenizer_json)


def test_cached_tokenizer_accepts_encoding_objects(tokenizer_json):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tokenizer_json))
    tok = CachedTokenizer(lambda text: raw.encode(text, add_special_tokens=False))
    assert tok.encode(TEXT) == IDS
