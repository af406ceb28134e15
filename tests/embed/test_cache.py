from __future__ import annotations

import pytest
import torch

from mmferry.embed.cache import EncoderCache, encode_with_cache
from mmferry.encoder.model import VisionEncoder, VisionOutput
from mmferry.items import MultimodalItem
from mmferry.models import spec_for

TINY = spec_for("qwen3_vl").tiny_config


@pytest.fixture(scope="module")
def enc():
    return VisionEncoder.random(config=TINY, seed=3)


def _image(seed: int, h: int = 4, w: int = 6) -> MultimodalItem:
    g = torch.Generator().manual_seed(seed)
    feat = torch.randint(0, 256, (h * w, 3 * TINY.patch_size**2), generator=g, dtype=torch.uint8)
    return MultimodalItem("image", feat, (1, h, w), "compact-u8", f"{seed:032x}")


def _counting(enc):
    calls: list[int] = []

    def encode(items):
        calls.append(len(items))
        return enc(items)

    return encode, calls


def test_duplicates_encode_once_and_hits_reuse(enc):
    a, b = _image(1), _image(2, 8, 4)
    cache = EncoderCache(1 << 20)
    encode, calls = _counting(enc)
    outs = encode_with_cache(encode, [a, b, a], cache)
    assert calls == [2]  # the repeated image is encoded once
    direct = enc([a, b])
    for got, want in zip(outs, [direct[0], direct[1], direct[0]]):
        assert torch.allclose(got.embeds, want.embeds, atol=1e-6)
        assert torch.allclose(got.deepstack[0], want.deepstack[0], atol=1e-6)
    again = encode_with_cache(encode, [b, a], cache)
    assert calls == [2] and cache.hits == 2
    assert again[0] is outs[1] and again[1] is outs[0]


def test_length_mismatch_reencodes_instead_of_trimming(enc):
    item = _image(5)  # 6 tokens
    cache = EncoderCache(1 << 20)
    # A colliding or stale entry under the same hash with 9 rows.
    cache.put(item.hash, VisionOutput(torch.zeros(9, 16), (torch.zeros(9, 16),)))
    encode, calls = _counting(enc)
    (out,) = encode_with_cache(encode, [item], cache)
    assert calls == [1] and cache.length_mismatches == 1
    assert out.embeds.shape == (item.num_tokens, TINY.out_hidden_size)
    assert torch.allclose(out.embeds, enc([item])[0].embeds, atol=1e-6)


def test_capacity_is_a_bound():
    one = VisionOutput(torch.zeros(4, 16), ())  # 256 bytes
    cache = EncoderCache(600)
    for k in "abc":
        assert cache.put(k, one)
        assert cache.used_bytes <= 600
    assert len(cache) == 2 and cache.get("a", 4) is None  # least recently used went first
    assert not cache.put("big", VisionOutput(torch.zeros(64, 16), ()))
    assert cache.used_bytes == 512
