"""The fast paths give today's outputs: channels-last resize, hf rows written once, seeking
video decode, pixel keys without copies, and the thread policy.

Each is checked bit for bit against a plain-torch statement of the straightforward formula.
"""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from mmferry.models import preset
from mmferry.preprocess import image as image_mod
from mmferry.preprocess import video_decode
from mmferry.preprocess.decode import decode_image
from mmferry.preprocess.image import process_image
from mmferry.preprocess.patchify import _patch_view, norm_affine, patchify
from mmferry.preprocess.threads import ENV_THREADS, preprocess_threads
from mmferry.preprocess.video import process_video, sample_indices

from . import reference as ref
from .conftest import encode, gradient
from .video_files import SeekLog

CFG = preset("qwen3-vl")


def _sources(rgb: np.ndarray) -> dict[str, object]:
    rgba = np.concatenate([rgb, rgb[..., :1]], -1)
    return {
        "jpeg": encode(Image.fromarray(rgb), "JPEG"),
        "png-gray": encode(Image.fromarray(rgb[..., 0]), "PNG"),
        "png-rgba": encode(Image.fromarray(rgba), "PNG"),
        "pil": Image.fromarray(rgb),
        "hwc": rgb,
        "hwc-gray": rgb[..., :1],
        "hwc-rgba": rgba,
        "chw-tensor": torch.from_numpy(rgb).permute(2, 0, 1).contiguous(),
        "chw-view": torch.from_numpy(rgb).permute(2, 0, 1),
    }


def test_resize_is_channels_last_and_bit_identical(monkeypatch):
    """Every source kind: the resize input is channels-last (torch's fast uint8 kernel), or
    4-byte pixels for a JPEG and an RGB PIL image, and the output equals today's formula, the
    resize of `pixels.unsqueeze(0)`."""
    real = image_mod.resize_u8
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def spy(frames, h, w):
        out = real(frames, h, w)
        seen.append((frames, out))
        return out

    monkeypatch.setattr(image_mod, "resize_u8", spy)
    rgb = gradient(333, 517, 3)
    for key, src in _sources(rgb).items():
        seen.clear()
        process_image(src, CFG, layout="compact-u8")
        ((frames, out),) = seen
        pixels = decode_image(src, CFG.max_decoded_pixels).pixels
        old = F.interpolate(
            pixels.unsqueeze(0), size=out.shape[-2:], mode="bicubic", antialias=True
        )
        assert torch.equal(out, old), key
        if key in ("jpeg", "pil"):
            # Decoded or copied into 4-byte pixels (decode.py): resized as four channels-last
            # channels.
            for t in (frames, out):
                _, _, h, w = t.shape
                assert t.stride() == (4 * h * w, 1, 4 * w, 4), key
            continue
        assert out.is_contiguous(memory_format=torch.channels_last), key
        if key not in ("chw-tensor", "hwc-gray", "png-gray"):  # no HWC memory to view
            assert frames.is_contiguous(memory_format=torch.channels_last), key


def _old_hf(frames: torch.Tensor, *, image: bool, temporal: int, mean, std) -> torch.Tensor:
    """Today's hf formula: uint8 gather, a widening copy, then the affine in place."""
    group = 1 if image else temporal
    src = _patch_view(frames, group, 16, 2)
    rows = src.shape[0] * src.shape[1] * src.shape[2] * 4
    compact = src.contiguous().view(rows, 3, group, 256)
    out = compact.expand(rows, 3, temporal, 256).to(torch.float32)
    scale, shift = norm_affine(mean, std)
    per_c = out.view(rows, 3, temporal * 256)
    torch.addcmul(shift.view(1, 3, 1), per_c, scale.view(1, 3, 1), out=per_c)
    return out.view(rows, -1)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("frames", "size"), [(1, (64, 96)), (1, (2976, 640)), (4, (96, 1920))])
def test_hf_one_pass_equals_three_passes(frames, size, threads):
    g = torch.Generator().manual_seed(frames * 7 + size[0])
    x = torch.randint(0, 256, (frames, *size, 3), dtype=torch.uint8, generator=g)
    x = x.permute(0, 3, 1, 2)  # channels-last, as resize_u8 returns
    image = frames == 1
    kw = dict(image=image, patch=16, merge=2, temporal=2, mean=(0.48, 0.45, 0.4), std=(0.26,) * 3)
    got = patchify(x, layout="hf", threads=threads, **kw)
    assert torch.equal(got, _old_hf(x, image=image, temporal=2, mean=kw["mean"], std=kw["std"]))
    compact = patchify(x, layout="compact-u8", threads=threads, **kw)
    assert torch.equal(compact, patchify(x.contiguous(), layout="compact-u8", threads=1, **kw))


def _gop_video(path, n: int, gop: int, codec: str = "libx264") -> np.ndarray:
    frames = ref.moving_frames(n, 64, 96, seed=n)
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=30)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        stream.codec_context.gop_size = gop
        if codec == "libx264":
            stream.options = {"bf": "2", "preset": "ultrafast", "keyint_min": str(gop)}
        for f in frames:
            for pkt in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(pkt)
        for pkt in stream.encode():
            out.mux(pkt)
    return frames


@pytest.mark.parametrize("codec", ["libx264", "mpeg4"])
def test_seeking_decode_gives_the_frames_of_a_full_decode(tmp_path, monkeypatch, codec):
    path = tmp_path / f"gop.{'mp4' if codec == 'libx264' else 'mkv'}"
    _gop_video(path, 300, 12, codec)
    data = path.read_bytes()
    info = video_decode.probe_video(data, "gop")
    assert len(info.keyframes) >= 20
    indices = [0, 3, 40, 41, 41, 150, 299]
    size = lambda h, w: (h, w)  # noqa: E731
    log = SeekLog(monkeypatch)
    fast = video_decode.decode_frames(data, "gop", indices, lambda h, w: None, size, info)
    # the gaps 3 -> 40 -> 150 -> 299 each pass keyframes, and the seeks found their frames
    log.assert_seek_path_succeeded(min_seeks=3)
    slow = video_decode.decode_frames(data, "gop", indices, lambda h, w: None, size, None)
    assert torch.equal(fast, slow)
    # and against transformers' reader, which decodes every frame
    from transformers.video_utils import read_video_pyav

    want, _ = read_video_pyav(str(path), sample_indices_fn=lambda metadata, **_: np.arange(300))
    assert torch.equal(fast.permute(0, 2, 3, 1), torch.from_numpy(want[indices]))


def test_seeking_video_item_matches_transformers(tmp_path, monkeypatch):
    path = tmp_path / "gop.mp4"
    _gop_video(path, 300, 10)
    log = SeekLog(monkeypatch)
    item = process_video(path, CFG, layout="hf", fps=0.5)
    log.assert_seek_path_succeeded(min_seeks=4)  # frames 0, 75, 150, 224, 299; keyint 10
    from transformers.video_utils import read_video_pyav

    frames, meta = read_video_pyav(
        str(path), sample_indices_fn=lambda metadata, **_: np.arange(300)
    )

    indices = sample_indices(CFG, 300, meta.fps, fps=0.5)
    size = ref.qwen3_video_size(CFG, len(indices), 64, 96)
    torch.testing.assert_close(
        item.feature, ref.video_hf(frames[indices], CFG, size), atol=1e-5, rtol=0
    )


def test_pixel_sources_are_keyed_without_copies(monkeypatch):
    """PIL and array sources are hashed over their pixels, in place: no `tobytes`,
    the same key for the same pixels whatever the source kind, and layout-independent."""

    def no_tobytes(self, *args, **kwargs):
        raise AssertionError("tobytes copies the image")

    rgb = gradient(300, 400, 9)
    monkeypatch.setattr(Image.Image, "tobytes", no_tobytes)
    a = process_image(Image.fromarray(rgb), CFG, layout="hf")
    b = process_image(rgb, CFG, layout="compact-u8")
    c = process_image(torch.from_numpy(rgb).permute(2, 0, 1), CFG)
    assert a.hash == b.hash == c.hash and len(a.hash) == 32
    flipped = rgb.copy()
    flipped[150, 200, 1] ^= 0x80
    assert process_image(flipped, CFG).hash != a.hash
    assert process_image(rgb, CFG.replace(image_max_pixels=1 << 16)).hash != a.hash


def test_thread_setting(monkeypatch):
    monkeypatch.delenv(ENV_THREADS, raising=False)
    assert preprocess_threads() == 1
    assert preprocess_threads(3) == 3
    monkeypatch.setenv(ENV_THREADS, "4")
    assert preprocess_threads() == 4
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(ENV_THREADS, bad)
        with pytest.raises(ValueError, match=ENV_THREADS):
            preprocess_threads()
    with pytest.raises(ValueError, match="threads must be a positive integer"):
        process_image(np.zeros((32, 32, 3), np.uint8), CFG, threads=0)
    before = torch.get_num_threads()
    rgb = gradient(1500, 2000, 4)
    one = process_image(rgb, CFG, threads=1)
    two = process_image(rgb, CFG, threads=2)
    assert torch.equal(one.feature, two.feature)
    assert torch.get_num_threads() == before


def test_decoded_bytes_are_read_once():
    data = encode(Image.fromarray(gradient(64, 64, 1)), "PNG")
    assert process_image(io.BytesIO(data), CFG).hash == process_image(data, CFG).hash


def test_strided_arrays_give_the_item_of_their_contiguous_copy():
    """Arrays that are views (planar memory seen as HWC, flipped, a channel slice, read-only)
    give the same feature rows and key as `np.ascontiguousarray` of them."""
    rgb = gradient(300, 400, 5)
    planar = np.ascontiguousarray(rgb.transpose(2, 0, 1)).transpose(1, 2, 0)
    rgba = np.concatenate([rgb, rgb[..., :1]], -1)
    readonly = rgb.copy()
    readonly.flags.writeable = False
    views = {
        "planar": planar,
        "flipped": rgb[::-1, ::-1],
        "channel slice": rgba[..., :3],
        "every other column": rgb[:, ::2],
        "read-only": readonly,
    }
    for name, view in views.items():
        for layout in ("hf", "compact-u8"):
            got = process_image(view, CFG, layout=layout)
            want = process_image(np.ascontiguousarray(view), CFG, layout=layout)
            assert torch.equal(got.feature, want.feature), (name, layout)
            assert got.hash == want.hash, (name, layout)


def test_jpeg_decodes_into_four_byte_pixels_with_the_same_result():
    """An upright RGB JPEG is decoded straight into mmferry's 4-byte-pixel buffer: the same
    pixels as Pillow's own decode, and the same rows as the decoded array gives, in both
    layouts. A turned JPEG (turned by Pillow) and an RGB PNG are copied out of Pillow's
    memory as 4-byte pixels (decode.py, _copy_rgbx), with the same result."""
    rgb = gradient(300, 400, 11)
    data = encode(Image.fromarray(rgb), "JPEG")
    decoded = decode_image(data, CFG.max_decoded_pixels).pixels
    assert decoded.stride() == (1, 4 * 400, 4)  # the 4-byte path was taken
    pillow = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert torch.equal(decoded, torch.from_numpy(pillow).permute(2, 0, 1))
    for layout in ("hf", "compact-u8"):
        got = process_image(data, CFG, layout=layout).feature
        assert torch.equal(got, process_image(pillow.copy(), CFG, layout=layout).feature)
    im = Image.fromarray(rgb)
    exif = im.getexif()
    exif[0x0112] = 6  # turned: exif_transpose makes a new image
    turned = encode(im, "JPEG", exif=exif.tobytes())
    upright = decode_image(turned, CFG.max_decoded_pixels).pixels
    assert upright.shape == (3, 400, 300) and upright.stride() == (1, 4 * 300, 4)
    shown = ImageOps.exif_transpose(Image.open(io.BytesIO(turned))).convert("RGB")
    assert torch.equal(upright, torch.from_numpy(np.array(shown)).permute(2, 0, 1))
    png = decode_image(encode(im, "PNG"), CFG.max_decoded_pixels).pixels
    assert png.stride() == (1, 4 * 400, 4)
    assert torch.equal(png, torch.from_numpy(rgb).permute(2, 0, 1))


def test_pil_rgb_is_copied_as_four_byte_pixels_with_the_same_result(monkeypatch):
    """A decoded RGB PIL image's pixels are copied as Pillow holds them (4 bytes a pixel, no
    pack to 3), and give the rows and the key of the same pixels as an array, in both layouts;
    the key packs them to 3 bytes a chunk at a time (chunks that end mid-row here), hashing
    the bytes the array's key hashes."""
    from mmferry.preprocess import decode
    from mmferry.preprocess.decode import PackedRGB, pixels_identity

    rgb = gradient(300, 400, 13)  # resized up: the source pixels are hashed
    pixels = decode_image(Image.fromarray(rgb), CFG.max_decoded_pixels).pixels
    assert pixels.stride() == (1, 4 * 400, 4)  # the 4-byte copy was taken
    assert torch.equal(pixels, torch.from_numpy(rgb).permute(2, 0, 1))
    parts = pixels_identity(pixels.permute(1, 2, 0), b"upright-hwc-u8")
    assert isinstance(parts[-1], PackedRGB)
    assert b"".join(bytes(c) for c in parts[-1].chunks()) == rgb.tobytes()
    monkeypatch.setattr(decode.PackedRGB, "CHUNK_BYTES", 1000)
    for layout in ("hf", "compact-u8"):
        got = process_image(Image.fromarray(rgb), CFG, layout=layout)
        want = process_image(rgb.copy(), CFG, layout=layout)
        assert torch.equal(got.feature, want.feature), layout
        assert got.hash == want.hash, layout
