"""Image features against transformers' Qwen-VL image processing.

(a) the hf layout equals, to 1e-5, a plain-torch statement of transformers' default
(torchvision) processor; (b) grids equal transformers' PIL processor exactly and pixels agree
within the documented PIL-vs-torch resampling difference; (c) compact-u8 turned back into the
hf layout equals the hf layout.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from mmferry.models import preset
from mmferry.preprocess.image import process_image
from mmferry.preprocess.samples import sample_images
from mmferry.testing.layouts import compact_to_hf

from . import reference as ref
from .conftest import gradient

PRESETS = ["qwen2-vl", "qwen3-vl"]


def _pil_processor(cfg) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        patch_size=cfg.patch_size,
        merge_size=cfg.merge_size,
        temporal_patch_size=cfg.temporal_patch_size,
        min_pixels=cfg.image_min_pixels,
        max_pixels=cfg.image_max_pixels,
        image_mean=list(cfg.image_mean),
        image_std=list(cfg.image_std),
    )


def _sources(odd_images) -> dict[str, bytes]:
    out = {p.name: p.read_bytes() for p in sample_images()}
    out.update(odd_images)
    return out


@pytest.mark.parametrize("name", PRESETS)
def test_hf_layout_matches_torch_formula(name, odd_images):
    cfg = preset(name)
    for key, data in _sources(odd_images).items():
        want, grid = ref.image_hf(ref.load_rgb(data), cfg)
        item = process_image(data, cfg, layout="hf")
        assert item.grid_thw == grid, key
        assert item.feature.dtype == torch.float32
        assert item.feature.shape == want.shape, key
        torch.testing.assert_close(item.feature, want, atol=1e-5, rtol=0, msg=key)
        compact = process_image(data, cfg, layout="compact-u8")
        assert compact.hash == item.hash
        assert compact.feature.dtype == torch.uint8
        assert compact.feature.shape == (want.shape[0], want.shape[1] // cfg.temporal_patch_size)
        torch.testing.assert_close(compact_to_hf(compact, cfg), item.feature, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", PRESETS)
def test_close_to_pil_processor(name, odd_images):
    """Same grids; PIL and torch bicubic differ by design, by a fraction of a level on average."""
    cfg = preset(name)
    proc = _pil_processor(cfg)
    std = torch.tensor(cfg.image_std).repeat_interleave(cfg.temporal_patch_size * cfg.patch_size**2)
    for key, data in _sources(odd_images).items():
        rgb = ref.load_rgb(data)
        out = proc(images=[Image.fromarray(rgb)], return_tensors="pt")
        item = process_image(data, cfg, layout="hf")
        assert item.grid_thw == tuple(out["image_grid_thw"][0].tolist()), key
        # Back to uint8 levels, per channel.
        levels = (item.feature - out["pixel_values"]).abs() * std * 255
        assert levels.mean() < 0.5, (key, levels.mean())
        assert levels.max() <= 20, (key, levels.max())


def test_patch_order_worked_case():
    """E7: a 64x96 Q3 image -> [24, 1536], grid (1, 4, 6), rows in 2x2 merge-block order."""
    cfg = preset("qwen3-vl").replace(image_min_pixels=4096)
    img = np.zeros((64, 96, 3), np.uint8)
    for r in range(4):
        for c in range(6):
            img[16 * r : 16 * r + 16, 16 * c : 16 * c + 16] = (10 * r + c, 100 + r, 200 - c)
    item = process_image(img, cfg, layout="hf")
    assert item.grid_thw == (1, 4, 6)
    assert item.feature.shape == (24, 1536)
    order = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    for row, (r, c) in enumerate(order):
        want = (torch.tensor([10 * r + c, 100 + r, 200 - c]) / 255 - 0.5) / 0.5
        got = item.feature[row].view(3, 2, 256)
        torch.testing.assert_close(got, want.view(3, 1, 1).expand(3, 2, 256))
    # The T copies of channel 0 are identical.
    assert torch.equal(item.feature[:, :256], item.feature[:, 256:512])
    compact = process_image(img, cfg, layout="compact-u8")
    assert compact.feature.shape == (24, 768)
    assert compact.feature[5, 0] == 10 * 0 + 3  # row 5 is patch (0, 3)


def test_source_kinds_agree(tmp_path):
    """Path, bytes, file, PIL, HWC array and CHW tensor give the same features."""
    cfg = preset("qwen3-vl")
    rgb = gradient(70, 130, 11)
    path = tmp_path / "x.png"
    Image.fromarray(rgb).save(path)
    want = process_image(path, cfg, layout="compact-u8")
    for src in (
        str(path),
        path.read_bytes(),
        io.BytesIO(path.read_bytes()),
        Image.open(path),
        rgb,
        torch.from_numpy(rgb).permute(2, 0, 1),
    ):
        got = process_image(src, cfg, layout="compact-u8")
        assert torch.equal(got.feature, want.feature), type(src)
        assert got.grid_thw == want.grid_thw
    # Encoded sources hash their bytes; pixel sources their pixels: same pixels, same key.
    assert process_image(rgb, cfg).hash == process_image(rgb.copy(), cfg).hash
    assert process_image(rgb, cfg).hash != process_image(rgb[::-1].copy(), cfg).hash


def test_array_alpha_and_gray_follow_transformers():
    cfg = preset("qwen2-vl")
    rgba = np.concatenate([gradient(40, 60, 12), gradient(40, 60, 13)[..., :1]], -1)
    gray = gradient(40, 60, 14)[..., :1]
    for arr in (rgba, gray):
        want, _ = ref.image_hf(ref.convert_to_rgb(arr, return_numpy=True), cfg)
        torch.testing.assert_close(process_image(arr, cfg).feature, want, atol=1e-5, rtol=0)


def test_hash_covers_settings_not_layout():
    data = sample_images()[1].read_bytes()
    cfg = preset("qwen3-vl")
    h = process_image(data, cfg).hash
    assert len(h) == 32 and int(h, 16) >= 0
    assert process_image(data, cfg, layout="compact-u8").hash == h
    assert process_image(data, cfg.replace(image_max_pixels=1 << 20)).hash != h
    assert process_image(data, preset("qwen2-vl")).hash != h
    assert process_image(data + b"\0", cfg).hash != h  # trailing byte: same pixels


def test_memory_format_does_not_change_resize():
    """torchvision feeds uint8 CHW views of HWC memory; contiguous input must agree."""
    rgb = torch.from_numpy(gradient(333, 517, 15))
    cl = rgb.permute(2, 0, 1)[None]
    a = torch.nn.functional.interpolate(cl, size=(224, 352), mode="bicubic", antialias=True)
    b = torch.nn.functional.interpolate(
        cl.contiguous(), size=(224, 352), mode="bicubic", antialias=True
    )
    assert torch.equal(a, b)


def test_pillow_fallback_path_agrees(monkeypatch, odd_images):
    """The one-pass RGB packing and the portable np.array path give the same features."""
    from mmferry.preprocess import decode

    cfg = preset("qwen2-vl")
    data = odd_images["rgb_jpeg_odd"]
    fast = process_image(data, cfg, layout="compact-u8").feature
    im = Image.open(io.BytesIO(data))
    im.load()
    assert np.array_equal(decode._pack_rgb(im), np.asarray(im))
    monkeypatch.setattr(decode, "_pack_rgb", lambda im: None)
    assert torch.equal(process_image(data, cfg, layout="compact-u8").feature, fast)
    monkeypatch.undo()

    def broken(*args, **kwargs):
        raise RuntimeError("encoder interface changed")

    monkeypatch.setattr(Image, "_getencoder", broken)
    assert decode._pack_rgb(im) is None


def test_pil_source_gets_exif_orientation(odd_images):
    cfg = preset("qwen3-vl")
    data = odd_images["exif_jpeg"]
    from_bytes = process_image(data, cfg, layout="compact-u8")
    from_pil = process_image(Image.open(io.BytesIO(data)), cfg, layout="compact-u8")
    assert from_bytes.grid_thw == from_pil.grid_thw == (1, 14, 22)  # 200x120 shown rotated
    assert torch.equal(from_bytes.feature, from_pil.feature)


def test_pil_hash_covers_orientation_and_transparency():
    # Same stored pixels, different upright pixels: the cache key must differ, or a cache hit
    # (same token count: a 90-degree turn swaps h and w) would serve the other image's rows.
    cfg = preset("qwen2-vl")
    arr = np.random.default_rng(0).integers(0, 256, (64, 128, 3), dtype=np.uint8)
    plain, turned = Image.fromarray(arr), Image.fromarray(arr)
    turned.getexif()[0x0112] = 6  # EXIF orientation: rotate 90 degrees
    a, b = process_image(plain, cfg), process_image(turned, cfg)
    assert a.grid_thw == (1, 4, 10) and b.grid_thw == (1, 10, 4)  # pixels really differ
    assert a.num_tokens == b.num_tokens and a.hash != b.hash
    gray, keyed = Image.fromarray(arr[..., 0]), Image.fromarray(arr[..., 0])
    keyed.info["transparency"] = int(arr[0, 0, 0])  # that grey level is shown as white
    c, d = process_image(gray, cfg), process_image(keyed, cfg)
    assert not torch.equal(c.feature, d.feature) and c.hash != d.hash
