"""Image sources -> an upright RGB uint8 `[C, H, W]` tensor plus the bytes that identify it.

Accepted sources: a path (str or Path), encoded bytes, a binary file-like object, a PIL image,
an HWC uint8 numpy array (1, 3 or 4 channels) or a CHW uint8 torch tensor (1, 3 or 4
channels). Conversion to RGB follows transformers' `convert_to_rgb`: anything with alpha is
composited onto white; EXIF orientation is applied as transformers' `load_image` does.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

_EXIF_ORIENTATION = 0x0112


@dataclass(frozen=True)
class DecodedImage:
    """Upright RGB pixels and the identity bytes hashed for the cache key."""

    # [3, H, W] uint8; may be a strided view (e.g. of an HWC array), never copied needlessly.
    pixels: torch.Tensor
    # Parts hashed (with the settings) to name the item; see hashing.py. Buffers, not copies.
    identity: tuple[bytes | memoryview, ...]


def describe(source: Any) -> str:
    """A short name for a source, used in error messages."""
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"<bytes of length {len(source)}>"
    if isinstance(source, Image.Image):
        return f"<PIL image {source.mode} {source.width}x{source.height}>"
    if isinstance(source, (np.ndarray, torch.Tensor)):
        return f"<{type(source).__name__} {tuple(source.shape)} {source.dtype}>"
    name = getattr(source, "name", None)
    return f"<file {name}>" if isinstance(name, str) else f"<{type(source).__name__}>"


def read_source_bytes(source: Any, kind: str = "image") -> bytes | None:
    """The encoded bytes of a path / bytes / file-like source; None for decoded sources."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"{kind} file not found: {path}")
        return path.read_bytes()
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if hasattr(source, "read"):
        data = source.read()
        if not isinstance(data, (bytes, bytearray)):
            raise ValueError(f"{describe(source)} is not opened in binary mode")
        return bytes(data)
    return None


def _open_checked(data: bytes, name: str, max_pixels: int) -> Image.Image:
    if not data:
        raise ValueError(f"cannot decode image {name}: it is empty")
    try:
        im = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise ValueError(f"image {name} is too large to decode safely: {e}") from None
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise ValueError(f"cannot decode image {name}: not a readable image ({e})") from None
    # NOTE: checked on the header size, before any pixel is decoded (decompression bombs).
    if im.width * im.height > max_pixels:
        raise ValueError(
            f"image {name} declares {im.width}x{im.height} = {im.width * im.height} pixels, "
            f"more than max_decoded_pixels={max_pixels}; raise the limit if it is trusted"
        )
    try:
        im.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"cannot decode image {name}: corrupt or truncated ({e})") from None
    return im


def _upright(im: Image.Image) -> Image.Image:
    # Reading the tag is cheap; exif_transpose copies, so call it only when it changes pixels.
    if im.getexif().get(_EXIF_ORIENTATION, 1) in (2, 3, 4, 5, 6, 7, 8):
        im = ImageOps.exif_transpose(im)
    return im


def _to_rgb(im: Image.Image) -> Image.Image:
    if im.mode == "RGB":
        return im
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return im.convert("RGB")


def _pack_rgb(im: Image.Image) -> np.ndarray | None:
    """RGB pixels packed straight into a writable [H, W, 3] array, in one pass.

    `np.asarray(im)` goes through `tobytes()`, which packs into 64 KiB chunks and then joins
    them: two passes over the image. Here each chunk is copied out while still in cache.
    Relies on Pillow's raw encoder interface; None (use the portable path) if it changes.
    """
    try:
        out = np.empty((im.height, im.width, 3), np.uint8)
        flat = memoryview(out).cast("B")
        enc = Image._getencoder("RGB", "raw", "RGB")
        enc.setimage(im.im, (0, 0, im.width, im.height))
        pos, err = 0, 0
        try:
            while not err:
                _, err, chunk = enc.encode(max(ImageFile.MAXBLOCK, im.width * 4))
                flat[pos : pos + len(chunk)] = chunk
                pos += len(chunk)
        finally:
            enc.cleanup()
    except Exception:  # noqa: BLE001 - any change in Pillow's internals: fall back
        return None
    return out if err > 0 and pos == out.nbytes else None


def _pil_to_chw(im: Image.Image) -> torch.Tensor:
    hwc = _pack_rgb(im)
    if hwc is None:
        hwc = np.array(im)  # [H, W, 3] uint8, writable
    return torch.from_numpy(hwc).permute(2, 0, 1)  # [3, H, W] view


def _array_to_chw(hwc: torch.Tensor, name: str) -> torch.Tensor:
    """[H, W, C] uint8 (C in 1, 3, 4) -> [3, H, W] uint8; alpha composited on white."""
    channels = hwc.shape[-1]
    if channels == 3:
        return hwc.permute(2, 0, 1)
    if channels == 1:
        return hwc.permute(2, 0, 1).expand(3, -1, -1)
    if channels == 4:
        # Same arithmetic as transformers' numpy convert_to_rgb: round(a*rgb + (1-a)*255).
        rgb = hwc[..., :3].double()
        alpha = hwc[..., 3:].double() / 255
        out = (alpha * rgb + (1 - alpha) * 255).round_().to(torch.uint8)
        return out.permute(2, 0, 1)
    raise ValueError(
        f"image {name} has {channels} channels; pass 1 (gray), 3 (RGB) or 4 (RGBA) channels"
    )


def _check_array(arr: np.ndarray | torch.Tensor, name: str, layout: str) -> None:
    if arr.ndim != 3:
        raise ValueError(
            f"image {name} must be a 3-d {layout} uint8 array, got {arr.ndim} dimension(s)"
        )
    if arr.dtype not in (np.uint8, torch.uint8):
        raise ValueError(
            f"image {name} has dtype {arr.dtype}; pass uint8 pixels in 0..255 "
            "(e.g. (x * 255).round().astype(np.uint8) for floats in 0..1)"
        )
    if min(arr.shape) == 0:
        raise ValueError(f"image {name} is empty: shape {tuple(arr.shape)}")


def pixels_identity(pixels: torch.Tensor, kind: bytes) -> tuple[bytes | memoryview, ...]:
    """Hash parts for raw pixels: kind, shape and the bytes (a view when contiguous)."""
    shape = ",".join(str(s) for s in pixels.shape).encode()
    return (kind, shape, memoryview(pixels.contiguous().numpy()).cast("B"))


def decode_image(source: Any, max_pixels: int) -> DecodedImage:
    """Decode any supported image source; ValueError naming the source when it cannot."""
    name = describe(source)
    if isinstance(source, np.ndarray):
        _check_array(source, name, "HWC")
        t = torch.from_numpy(np.ascontiguousarray(source))
        return DecodedImage(_array_to_chw(t, name), pixels_identity(t, b"hwc-u8"))
    if isinstance(source, torch.Tensor):
        _check_array(source, name, "CHW")
        t = source.detach().cpu()
        if t.shape[0] not in (1, 3, 4) and t.shape[-1] in (1, 3, 4):
            raise ValueError(f"image {name} looks channels-last; tensors must be CHW")
        return DecodedImage(_array_to_chw(t.permute(1, 2, 0), name), pixels_identity(t, b"chw-u8"))
    if isinstance(source, Image.Image):
        if source.width * source.height > max_pixels:
            raise ValueError(f"image {name} exceeds max_decoded_pixels={max_pixels}")
        palette = source.palette.tobytes() if source.mode == "P" and source.palette else b""
        # NOTE: orientation and a transparency key change the upright RGB pixels, so they are
        # part of the identity; the stored bytes alone are not.
        shown = f"{source.getexif().get(_EXIF_ORIENTATION, 1)}|{source.info.get('transparency')!r}"
        ident = (
            b"pil",
            source.mode.encode(),
            f"{source.size}".encode(),
            source.tobytes(),
            palette,
            shown.encode(),
        )
        return DecodedImage(_pil_to_chw(_to_rgb(_upright(source))), ident)
    data = read_source_bytes(source)
    if data is None:
        raise ValueError(
            f"unsupported image source {name}; pass a path, bytes, a binary file, a PIL image, "
            "an HWC uint8 numpy array or a CHW uint8 torch tensor"
        )
    im = _open_checked(data, name, max_pixels)
    return DecodedImage(_pil_to_chw(_to_rgb(_upright(im))), (b"encoded", data))
