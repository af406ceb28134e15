"""Where the service parses a JSON body: in place when small, or when of few values up to
`FEW_VALUES_BYTES` (images as data: URLs); in the child process otherwise. The same value
either way."""

from __future__ import annotations

import asyncio
import base64
import json
import os
from typing import Any

import pytest

from mmferry.server.json_child import FEW_VALUES, FEW_VALUES_BYTES, INLINE_BYTES, JsonChild


def images(nbytes: int) -> bytes:
    """A chat-like body of four data: URLs, about `nbytes` long."""
    part = base64.b64encode(os.urandom(nbytes * 3 // 16)).decode()
    url = {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + part}}
    return json.dumps({"content": [{"type": "text", "text": "hi"}, *[url] * 4]}).encode()


def numbers(count: int) -> bytes:
    return json.dumps({"values": list(range(count))}).encode()


def parse(raw: bytes) -> tuple[Any, bool]:
    """The value, and whether the child process parsed it."""

    async def run() -> tuple[Any, bool]:
        child = JsonChild()
        try:
            return await child.parse(raw), child._proc is not None
        finally:
            await child.close()

    return asyncio.run(run())


@pytest.mark.parametrize(
    "raw, in_child",
    [
        (images(INLINE_BYTES // 2), False),
        (images(INLINE_BYTES * 2), False),  # few values: in place
        (images(FEW_VALUES_BYTES - 4096), False),
        (images(FEW_VALUES_BYTES + 4096), True),  # past the size for few values
        (numbers(15_000), True),  # under the size for few values, but many
        (numbers(4000)[: INLINE_BYTES // 4], None),  # cut short: refused either way
    ],
    ids=["small", "few-values", "few-values-at-the-size", "past-the-size", "many-values", "bad"],
)
def test_where_a_body_is_parsed(raw, in_child):
    if in_child is None:
        with pytest.raises(Exception, match="JSON"):
            parse(raw)
        return
    assert len(raw) > INLINE_BYTES or not in_child
    assert in_child or len(raw) <= INLINE_BYTES or raw.count(b",") <= FEW_VALUES
    value, child = parse(raw)
    assert value == json.loads(raw)
    assert child is in_child


SPECIAL = {
    "nan": (b"NaN", lambda v: v != v),
    "infinity": (b"-Infinity", lambda v: v == float("-inf")),
    "big": (b"123456789012345678901234567890", lambda v: v == 123456789012345678901234567890),
    "surrogate": (b'"\\ud800"', lambda v: v == "\ud800"),
}


@pytest.mark.parametrize("special", list(SPECIAL))
@pytest.mark.parametrize("raw", [b"", numbers(15_000)[:-1]], ids=["in-place", "in-the-child"])
def test_a_body_is_written_back_with_its_own_values(raw, special):
    """NaN, the infinities, integers past 64 bits and lone surrogates come back out of
    `dump_json` as the client wrote them (orjson alone writes null or refuses), wherever the
    body was parsed."""
    from mmferry.server.bodies import dump_json

    spelled, same = SPECIAL[special]
    body = (raw or b'{"values": [1]') + b', "x": ' + spelled + b"}"
    value, in_child = parse(body)
    assert in_child == bool(raw)
    back = json.loads(dump_json(value))
    assert same(back["x"]), back["x"]
    assert back["values"] == json.loads(body)["values"]
