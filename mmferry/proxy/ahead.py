"""Naming a request's images ahead of their encode (`mmferry proxy --name-ahead`).

In connector mode the engine needs each item's hash (its uuid) and grid, not its rows, to plan
the request; its connector loads the rows later. The encoders name an encoded image by its
bytes and their processor's settings (`item_hash`), and size it from its header and the resize
rule (`encoded_image_facts`), so the proxy, given the same settings (`GET /v1/cache/processor`
of every encoder, all alike), names it the same way without decoding it, and sends the request
to the engine beside the encode instead of after it. The encode call carries the names
(`announced`): the encoder has the items pending to lookups from the moment it reads them, and
holds an item only where its own facts are the proxy's (else the proxy sends the request again
the usual way). The engine's connector, told by the name's `+<rank>` which encoder to wait for,
waits while that encoder does not know the item yet (routing.py, engines/presence.py).

Only images given as data: URLs without per-item keys are named here (a remote URL would be
fetched twice; a video's frame count needs its container read); a request with any other item,
or one whose header does not read, goes the usual way, where the encoder's refusal is the
client's answer.
"""

from __future__ import annotations

import binascii
import dataclasses
from collections.abc import Sequence
from typing import Any

from mmferry.chat.base64_text import decode_base64
from mmferry.chat.sources import Reference
from mmferry.config import ProcessorConfig, TokenIds
from mmferry.proxy.media import Encoded, Media

PROCESSOR = "/v1/cache/processor"
# Payloads past this many base64 characters in one request are decoded off the event loop.
INLINE_CHARS = 1 << 18


def processor_config(doc: Any) -> ProcessorConfig | None:
    """The settings an encoder's `GET /v1/cache/processor` answered; None for an encoder whose
    items the engine plans from their pixels (the generic family); ValueError for an answer
    that is not the protocol's."""
    if not isinstance(doc, dict) or "processor" not in doc:
        raise ValueError("the answer has no 'processor'")
    given = doc["processor"]
    if given is None:
        return None
    if not isinstance(given, dict) or not isinstance(given.get("tokens"), dict):
        raise ValueError("'processor' must be an object of settings")
    fields = {f.name for f in dataclasses.fields(ProcessorConfig)}
    if set(given) != fields:
        raise ValueError(f"'processor' names {sorted(given)}, not {sorted(fields)}")
    for f in dataclasses.fields(ProcessorConfig):
        value = given[f.name]
        if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"'processor.{f.name}' must be a whole number, got {value!r}")
    settings = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items()}
    try:
        settings["tokens"] = TokenIds(**given["tokens"])
        return ProcessorConfig(**settings)
    except (TypeError, ValueError) as e:
        raise ValueError(f"'processor' does not make settings: {e}") from None


def nameable(media: Sequence[Media]) -> bool:
    """Whether every item is one the proxy names itself: an image sent as a data: URL without
    per-item keys."""
    return all(
        m.modality == "image"
        and not m.part.options
        and isinstance(m.part.source, Reference)
        and m.part.source.scheme == "data"
        for m in media
    )


def name_items(media: Sequence[Media], cfg: ProcessorConfig) -> list[Encoded] | None:
    """Each item's facts as its encoder will find them (hash and grid), or None when one of
    them cannot be named from its header (the encoder then says why)."""
    from mmferry.preprocess.image import encoded_image_facts

    named = []
    for m in media:
        assert isinstance(m.part.source, Reference)
        try:
            data = decode_base64(m.part.source.value)
            key, grid = encoded_image_facts(data, cfg)
        except (binascii.Error, ValueError):
            return None
        facts = {
            "modality": "image",
            "hash": key,
            "grid_thw": list(grid),
            "pixels": False,
            "timestamps": None,
        }
        named.append(Encoded(facts))
    return named


def payload_chars(media: Sequence[Media]) -> int:
    """The base64 characters `name_items` decodes."""
    return sum(len(m.part.source.value) for m in media if isinstance(m.part.source, Reference))


def same_item(named: Encoded, answered: Encoded | None) -> bool:
    """Whether the encoder holds the item under the name the proxy gave it."""
    if answered is None:
        return False
    want, got = named.facts, answered.facts
    return got["hash"] == want["hash"] and list(got["grid_thw"]) == want["grid_thw"]
