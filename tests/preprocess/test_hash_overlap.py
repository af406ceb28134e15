"""Large items are hashed on one extra thread while patchify gathers (threads.alongside).

The keys are cache keys, so the overlapped hash must equal the inline one bit for bit, and an
error on either side must surface from the call with no hash work left running after it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from mmferry.models import preset
from mmferry.preprocess import image as image_mod
from mmferry.preprocess import threads as threads_mod
from mmferry.preprocess import video as video_mod
from mmferry.preprocess.decode import as_batch, decode_image, pixels_identity
from mmferry.preprocess.hashing import item_hash
from mmferry.preprocess.image import process_image
from mmferry.preprocess.patchify import resize_u8
from mmferry.preprocess.resize import smart_resize
from mmferry.preprocess.threads import alongside
from mmferry.preprocess.video import process_video

from . import reference as ref
from .conftest import gradient

CFG = preset("qwen3-vl")
PREFIX = "mmferry-alongside"


def _hash_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(PREFIX)]


def _recording(monkeypatch: pytest.MonkeyPatch, module: object) -> list[str]:
    """Make `module.item_hash` note the thread it runs on; returns the list of names."""
    names: list[str] = []

    def recorded(*args: Any) -> str:
        names.append(threading.current_thread().name)
        return item_hash(*args)

    monkeypatch.setattr(module, "item_hash", recorded)
    return names


@pytest.mark.parametrize("layout", ["hf", "compact-u8"])
@pytest.mark.parametrize(
    ("size", "max_pixels", "kind"),
    [
        ((320, 416), None, b"upright-hwc-u8"),  # kept at its size: the source is hashed
        ((150, 250), None, b"upright-hwc-u8"),  # grows to 160x256: the smaller source
        ((600, 800), 320 * 416, b"resized-hwc-u8"),  # shrinks: the smaller resized pixels
    ],
)
def test_image_hash_overlapped_equals_inline(monkeypatch, layout, size, max_pixels, kind):
    cfg = CFG if max_pixels is None else CFG.replace(image_max_pixels=max_pixels)
    rgb = gradient(*size, seed=5)
    names = _recording(monkeypatch, image_mod)
    monkeypatch.setattr(threads_mod, "PARALLEL_MIN_BYTES", 1 << 62)
    inline = process_image(rgb, cfg, layout=layout)
    monkeypatch.setattr(threads_mod, "PARALLEL_MIN_BYTES", 0)
    overlapped = process_image(rgb, cfg, layout=layout)
    assert names[0] == threading.current_thread().name and names[1].startswith(PREFIX)
    # The same bytes in the same order as a plain hash of the smaller of the source and the
    # resized pixels (HWC), tagged with which it is.
    h, w = smart_resize(
        *size, factor=cfg.factor, min_pixels=cfg.image_min_pixels, max_pixels=cfg.image_max_pixels
    )
    if kind == b"upright-hwc-u8":
        assert size[0] * size[1] <= h * w
        pixels = torch.from_numpy(rgb)
    else:
        assert size[0] * size[1] > h * w
        decoded = decode_image(rgb, cfg.max_decoded_pixels).pixels
        pixels = resize_u8(as_batch(decoded), h, w)[0].permute(1, 2, 0)
    plain = item_hash("image", pixels_identity(pixels, kind), cfg)
    assert inline.hash == overlapped.hash == plain
    assert (inline.feature == overlapped.feature).all()
    assert not _hash_threads()


def test_large_image_hashes_alongside_by_default(monkeypatch):
    names = _recording(monkeypatch, image_mod)
    rgb = gradient(1200, 1600, seed=6)  # 5.8 MB resized: above PARALLEL_MIN_BYTES
    item = process_image(rgb, CFG, layout="compact-u8")
    small = process_image(rgb[:64, :64].copy(), CFG, layout="compact-u8")
    assert names[0].startswith(PREFIX) and names[1] == threading.current_thread().name
    monkeypatch.setattr(threads_mod, "PARALLEL_MIN_BYTES", 1 << 62)
    assert process_image(rgb, CFG, layout="compact-u8").hash == item.hash
    assert process_image(rgb[:64, :64].copy(), CFG, layout="compact-u8").hash == small.hash


@pytest.mark.parametrize("source", ["array", "pil-frames"])
def test_video_hash_overlapped_equals_inline(monkeypatch, source):
    frames = ref.moving_frames(6, 32, 48, seed=3)
    video = frames if source == "array" else [f for f in frames]
    names = _recording(monkeypatch, video_mod)
    monkeypatch.setattr(threads_mod, "PARALLEL_MIN_BYTES", 1 << 62)
    inline = process_video(video, CFG, layout="compact-u8", source_fps=6)
    monkeypatch.setattr(threads_mod, "PARALLEL_MIN_BYTES", 0)
    overlapped = process_video(video, CFG, layout="compact-u8", source_fps=6)
    assert names[0] == threading.current_thread().name and names[1].startswith(PREFIX)
    assert inline.hash == overlapped.hash
    assert (inline.feature == overlapped.feature).all()
    assert not _hash_threads()


def test_hash_error_propagates(monkeypatch):
    def broken(*args: object) -> str:
        raise RuntimeError("hash failed")

    monkeypatch.setattr(image_mod, "item_hash", broken)
    for threshold in (0, 1 << 62):  # overlapped, then inline
        monkeypatch.setattr(threads_mod, "PARALLEL_MIN_BYTES", threshold)
        with pytest.raises(RuntimeError, match="hash failed"):
            process_image(gradient(64, 96), CFG, layout="compact-u8")
        assert not _hash_threads()


def test_gather_error_waits_for_the_hash(monkeypatch):
    done: list[bool] = []

    def slow_hash(*args: Any) -> str:
        time.sleep(0.2)
        done.append(True)
        return item_hash(*args)

    def broken_patchify(*args: object, **kwargs: object) -> None:
        raise RuntimeError("gather failed")

    monkeypatch.setattr(threads_mod, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(image_mod, "item_hash", slow_hash)
    monkeypatch.setattr(image_mod, "patchify", broken_patchify)
    with pytest.raises(RuntimeError, match="gather failed"):
        process_image(gradient(64, 96), CFG, layout="compact-u8")
    # The call returned only after the hash reading its pixels had finished.
    assert done == [True] and not _hash_threads()


def test_alongside_inline_below_threshold():
    caller = threading.current_thread().name
    with alongside(lambda: threading.current_thread().name, 10) as result:
        pass
    assert result() == caller
    with alongside(lambda: threading.current_thread().name, 1 << 30) as result:
        name = result()
    assert name.startswith(PREFIX) and not _hash_threads()

    def fails() -> int:
        raise ValueError("bad part")

    with pytest.raises(ValueError, match="bad part"), alongside(fails, 1 << 30) as result:
        result()
    assert not _hash_threads()


@pytest.mark.parametrize("failing", ["hash", "gather"])
def test_video_errors_propagate_after_the_hash(monkeypatch, failing):
    done: list[bool] = []

    def slow_hash(*args: Any) -> str:
        time.sleep(0.2)
        if failing == "hash":
            raise RuntimeError("hash failed")
        done.append(True)
        return item_hash(*args)

    def broken_patchify(*args: object, **kwargs: object) -> None:
        raise RuntimeError("gather failed")

    monkeypatch.setattr(threads_mod, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(video_mod, "item_hash", slow_hash)
    if failing == "gather":
        monkeypatch.setattr(video_mod, "patchify", broken_patchify)
    with pytest.raises(RuntimeError, match=f"{failing} failed"):
        process_video(ref.moving_frames(6, 32, 48, seed=3), CFG, source_fps=6)
    assert done == ([True] if failing == "gather" else []) and not _hash_threads()
