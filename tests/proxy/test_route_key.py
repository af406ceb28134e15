"""The proxy's routing key: equal for the same source sent the same way with the same options,
different where any of them differs, so repeats reach the encoder that caches them."""

from __future__ import annotations

import base64

from mmferry.proxy.media import find_media
from mmferry.server.limits import Limits
from mmferry.server.sources import source_policy


def keys(*parts: dict) -> list[str]:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}]}
    return [m.key for m in find_media(body, source_policy(Limits()))]


def image(payload: bytes, **options) -> dict:
    url = "data:image/png;base64," + base64.b64encode(payload).decode()
    return {"type": "image_url", "image_url": {"url": url}, **options}


def video(*frames: bytes) -> dict:
    urls = ["data:image/png;base64," + base64.b64encode(f).decode() for f in frames]
    return {"type": "video", "video": urls}


def test_the_same_source_and_options_route_alike():
    a, b = keys(image(b"\x89PNG one"), image(b"\x89PNG one"))
    assert a == b and len(a) == 32
    assert (
        keys(image(b"\x89PNG one", max_pixels=4096))[0]
        == keys(image(b"\x89PNG one", max_pixels=4096))[0]
    )


def test_any_difference_routes_apart():
    base = keys(image(b"\x89PNG one"))[0]
    others = [
        keys(image(b"\x89PNG two"))[0],  # other bytes
        keys(image(b"\x89PNG one", max_pixels=4096))[0],  # other options
        keys(video(b"\x89PNG one"))[0],  # the same bytes as a video's one frame
    ]
    assert base not in others and len(set(others)) == len(others)
    assert keys(video(b"abc", b"def"))[0] != keys(video(b"def", b"abc"))[0]  # frame order
