"""The one thing prompt expansion needs from a tokenizer: ids for Qwen3-VL timestamp text.

Qwen3-VL writes each video frame's time into the prompt (`<1.3 seconds>`), so expanding a
video placeholder needs the checkpoint's own tokenizer. Timestamps repeat across videos (every
2 fps clip starts `<0.3 seconds>`, `<1.3 seconds>`, ...), so each distinct string is encoded once.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

_INSTALL_HINT = "pip install 'mmferry[tokenizer]'"
_MISSING_TOKENIZER = (
    "Qwen3-VL video prompts need the checkpoint's tokenizer to write each frame's timestamp "
    "text; pass `tokenizer=` (a path to tokenizer.json, a `tokenizers.Tokenizer` or a "
    "transformers tokenizer) to Processor, or use Processor.from_pretrained on a folder that "
    "holds tokenizer.json"
)


@runtime_checkable
class TimestampTokenizer(Protocol):
    """Encodes plain text (no special tokens added) to token ids."""

    def encode(self, text: str) -> list[int]: ...


class CachedTokenizer:
    """A tokenizer behind `encode(text) -> list[int]`: no special tokens, each string once.

    With `decode_fn` and `added_ids` (the ids that split text into pieces tokenised apart, as a
    tokenizer's added tokens do) it can also re-tokenise text that now abuts new text
    (`joined`)."""

    def __init__(
        self,
        encode_fn: Callable[[str], Any],
        *,
        maxsize: int = 4096,
        decode_fn: Callable[[list[int]], str] | None = None,
        added_ids: frozenset[int] = frozenset(),
    ) -> None:
        self._decode = decode_fn
        self.added_ids = added_ids

        def encode_once(text: str) -> tuple[int, ...]:
            out = encode_fn(text)
            ids = getattr(out, "ids", out)  # tokenizers.Encoding carries its ids in `.ids`
            return tuple(int(i) for i in ids)

        # NOTE: cached values are tuples so no caller can mutate a shared entry.
        self._encode = functools.lru_cache(maxsize=maxsize)(encode_once)
        self._encode_once = encode_once

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    def encode_uncached(self, text: str) -> list[int]:
        """Ids of text seen once (a whole rendered prompt), kept out of the cache."""
        return list(self._encode_once(text))

    def encode_cached(self, text: str) -> tuple[int, ...]:
        """The cached ids as an immutable tuple (no copy)."""
        return self._encode(text)

    def joined(self, ids: list[int], text: str) -> list[int] | None:
        """The ids of (the text `ids` spell) + `text` tokenised as one piece, as a processor
        that writes `text` straight after them gets; None when this tokenizer cannot tell (no
        decoder, or `ids` do not survive a round trip through their text)."""
        if self._decode is None:
            return None
        before = self._decode(ids)
        if list(self._encode_once(before)) != ids:
            return None
        return list(self._encode_once(before + text))


def _accepts_add_special_tokens(encode: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(encode).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return any(
        p.name == "add_special_tokens" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params
    )


def _from_file(path: Path) -> CachedTokenizer:
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError(
            f"reading {path} needs the `tokenizers` package: {_INSTALL_HINT}"
        ) from None
    return _from_tokenizers(Tokenizer.from_file(str(path)))


def _from_tokenizers(tok: Any) -> CachedTokenizer:
    """A `tokenizers.Tokenizer`: every added token splits the text it sits in."""
    return CachedTokenizer(
        lambda text: tok.encode(text, add_special_tokens=False).ids,
        decode_fn=lambda ids: tok.decode(ids, skip_special_tokens=False),
        added_ids=frozenset(tok.get_added_tokens_decoder()),
    )


def load_tokenizer(x: Any) -> CachedTokenizer:
    """A cached encoder from a tokenizer.json path, a tokenizer object or anything with `encode`."""
    if x is None:
        raise ValueError(_MISSING_TOKENIZER)
    if isinstance(x, CachedTokenizer):
        return x
    if isinstance(x, (str, Path)):
        return _from_file(Path(x))
    encode = getattr(x, "encode", None)
    if not callable(encode):
        raise TypeError(
            f"cannot use a {type(x).__name__} as a tokenizer: it has no encode(text) method; "
            "pass a path to tokenizer.json, a tokenizers.Tokenizer or a transformers tokenizer"
        )
    # `tokenizers.Tokenizer` and transformers tokenizers both add BOS/EOS-style tokens unless
    # told not to; the timestamp sits in the middle of a prompt, so it must not get any.
    if type(x).__module__.startswith("tokenizers"):
        return _from_tokenizers(x)
    if _accepts_add_special_tokens(encode):
        added = getattr(x, "added_tokens_decoder", None)
        decode = getattr(x, "decode", None)
        if isinstance(added, dict) and callable(decode):  # a transformers tokenizer
            return CachedTokenizer(
                lambda text: encode(text, add_special_tokens=False),
                decode_fn=lambda ids: decode(
                    ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
                ),
                added_ids=frozenset(int(i) for i in added),
            )
        return CachedTokenizer(lambda text: encode(text, add_special_tokens=False))
    return CachedTokenizer(encode)
