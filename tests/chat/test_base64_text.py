"""A data: URL's payload decoded as the standard library decodes it (`validate=True`), its
answer and its errors, whichever decoder runs."""

from __future__ import annotations

import base64
import binascii

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmferry.chat import base64_text
from mmferry.chat.base64_text import decode_base64


def _stdlib(text: str | bytes) -> bytes | type[Exception]:
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error:
        return binascii.Error
    except ValueError:
        return ValueError


def _ours(text: str | bytes) -> bytes | type[Exception]:
    try:
        return decode_base64(text)
    except binascii.Error:
        return binascii.Error
    except ValueError:
        return ValueError


EDGES = [
    "", "Zm9v", "Zm9vYg==", "Zm9vYmE=", "Zm9", "Zm9v=", "Zm9vYg=", "Zm9vYg===", "=Zm9v",
    "Zm 9v", "Zm9v\n", "Zm9v\r\n", "Zm-_", "Zm+/", "////", "ab=c", "é", "Zm9vé", "\x00Zm9v",
]  # fmt: skip

# Base64 text of random bytes, then cut, padded, or given a stray character somewhere.
_mutated = st.tuples(
    st.binary(max_size=300).map(lambda b: base64.b64encode(b).decode()),
    st.integers(0, 400),
    st.sampled_from(["", "=", "==", " ", "\n", "-", "_", "!", "é", "A", "\x00"]),
    st.booleans(),
).map(lambda t: t[0][: t[1]] + t[2] if t[3] else t[0][: t[1]] + t[2] + t[0][t[1] :])


@pytest.mark.parametrize("fast", [True, False], ids=["pybase64", "stdlib-only"])
def test_edges_decode_as_the_standard_library_does(fast, monkeypatch):
    if not fast:
        monkeypatch.setattr(base64_text, "_fast", None)
    for text in EDGES:
        assert _ours(text) == _stdlib(text), repr(text)
        if text.isascii():
            assert _ours(text.encode()) == _stdlib(text.encode()), repr(text)


@settings(max_examples=500, deadline=None)
@given(_mutated)
def test_any_text_decodes_as_the_standard_library_does(text):
    assert _ours(text) == _stdlib(text)


def test_the_simd_decoder_is_installed_with_the_server_extra():
    """The dev and server environments carry pybase64: without it every data: URL is decoded
    at the standard library's scalar speed (30 times slower)."""
    assert base64_text._fast is not None
