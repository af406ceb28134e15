"""Image sources -> an upright RGB uint8 `[C, H, W]` tensor plus the bytes that identify it.

Accepted sources: a path (str or Path), encoded bytes, a binary file-like object, a PIL image,
an HWC uint8 numpy array (1, 3 or 4 channels) or a CHW uint8 torch tensor (1, 3 or 4
channels). Conversion to RGB follows transformers' `convert_to_rgb`: anything with alpha is
composited onto white; EXIF orientation is applied as transformers' `load_image` does.
High-bit greyscale (16-bit, 32-bit integer, float) is scaled to 8 bits instead of clipped.
An animated image gives its first frame (a PIL image: the frame it is on).
"""

from __future__ import annotations

import io
import os
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageFile, UnidentifiedImageError

from mmferry.preprocess import kernels
from mmferry.preprocess.buffers import empty_host
from mmferry.preprocess.hashing import ChunkedPart

_EXIF_ORIENTATION = 0x0112
# Pillow's bytes per pixel by mode, to bound a decode's memory from the header alone.
_MODE_BYTES = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16B": 2, "I;16L": 2, "I;16N": 2}
# NOTE: a decode may hold this many bytes per allowed pixel (512 MiB at the default limit):
# Pillow's decoded image plus one packed RGB array. Non-RGB modes convert in strips of this
# many pixels, so no whole-image intermediate (RGBA, composite) is ever held.
BYTES_PER_ALLOWED_PIXEL = 4
_STRIP_PIXELS = 1 << 18
# NOTE: what Pillow's format plugins raise for a malformed header, metadata block or pixel
# stream: besides OSError, a non-numeric PPM field is a ValueError from int(), a PNG text or
# ICC chunk that inflates past Pillow's limit a ValueError, an unknown DDS layout a
# NotImplementedError, a short TIFF/EXIF field a struct.error. All are facts about the bytes,
# so each becomes a ValueError naming the source (a 4xx in the service, a skipped input in
# `mmferry encode`), never a crash.
_UNREADABLE = (
    OSError,
    SyntaxError,
    ValueError,
    NotImplementedError,
    EOFError,
    IndexError,
    KeyError,
    TypeError,
    ZeroDivisionError,
    OverflowError,
    struct.error,
)


@dataclass(frozen=True)
class DecodedImage:
    """Upright RGB pixels and, for encoded sources, the bytes hashed for the cache key."""

    # [3, H, W] uint8; may be a strided view (e.g. of an HWC array), never copied needlessly.
    pixels: torch.Tensor
    # Encoded sources: the parts hashed (with the settings) to name the item, see hashing.py.
    # None for decoded sources (PIL, arrays): their key covers their pixels instead (image.py).
    identity: tuple[bytes | memoryview, ...] | None


_NAME_LIMIT = 160  # characters of a path shown in a message


def describe(source: Any) -> str:
    """A short name for a source, used in error messages."""
    if isinstance(source, (str, os.PathLike)):
        # NOTE: bounded, keeping the end (the file's name): a message never echoes a whole
        # client's path.
        text = str(source)
        return text if len(text) <= _NAME_LIMIT else "..." + text[-(_NAME_LIMIT - 3) :]
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


# EXIF orientation -> the turn that shows the stored pixels upright (ImageOps.exif_transpose's).
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def _orientation(im: Image.Image) -> int:
    # A tag Pillow cannot read as a number (stored as text, as several values) is ignored,
    # as exif_transpose ignores it: no viewer could apply it either.
    value = im.getexif().get(_EXIF_ORIENTATION, 1)
    return value if isinstance(value, int) and value in _UPRIGHT else 1


def decode_peak_bytes(im: Image.Image) -> int:
    """Most bytes decoding and converting `im` holds at once (known from the header)."""
    src = _MODE_BYTES.get(im.mode, 4) * im.width * im.height
    # exif_transpose makes one turned copy in the source mode.
    turned = src if _orientation(im) != 1 else 0
    return src + turned + 3 * im.width * im.height


def _open_checked(data: bytes, name: str, max_pixels: int) -> Image.Image:
    if not data:
        raise ValueError(f"cannot decode image {name}: it is empty")
    try:
        im = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise ValueError(f"image {name} is too large to decode safely: {e}") from None
    except UnidentifiedImageError:
        # NOTE: Pillow's message names its BytesIO object, which tells nobody anything.
        raise ValueError(
            f"cannot decode image {name}: not a readable image (no image format Pillow reads "
            f"starts with {data[:8]!r})"
        ) from None
    except _UNREADABLE as e:
        raise ValueError(f"cannot decode image {name}: corrupt header or metadata ({e})") from None
    # NOTE: checked on the header size, before any pixel is decoded (decompression bombs).
    if im.width * im.height > max_pixels:
        raise ValueError(
            f"image {name} declares {im.width}x{im.height} = {im.width * im.height} pixels, "
            f"more than max_decoded_pixels={max_pixels}; raise the limit if it is trusted"
        )
    try:
        peak = decode_peak_bytes(im)  # reads the EXIF block, which may be cut short
    except _UNREADABLE as e:
        raise ValueError(f"cannot decode image {name}: corrupt or truncated ({e})") from None
    budget = BYTES_PER_ALLOWED_PIXEL * max_pixels
    if peak > budget:
        raise ValueError(
            f"image {name} ({im.mode} {im.width}x{im.height}) needs about {peak >> 20} MiB to "
            f"decode, more than {budget >> 20} MiB ({BYTES_PER_ALLOWED_PIXEL} bytes per pixel "
            f"of max_decoded_pixels={max_pixels}); raise the limit if it is trusted"
        )
    return im


def encoded_identity(data: bytes) -> tuple[bytes, bytes]:
    """The parts an encoded image's key is hashed over (with the settings): its bytes."""
    return (b"encoded", data)


def upright_size(data: bytes, max_pixels: int) -> tuple[int, int]:
    """(height, width) of the encoded image `data` as `decode_image` decodes it (turned by its
    EXIF orientation), read from its header alone; ValueError as `decode_image` refuses it."""
    im = _open_checked(data, describe(data), max_pixels)
    turned = _orientation(im) in (5, 6, 7, 8)  # a quarter turn swaps the sides
    return (im.width, im.height) if turned else (im.height, im.width)


def _load(im: Image.Image, name: str) -> None:
    try:
        im.load()
    except (*_UNREADABLE, Image.DecompressionBombError) as e:
        raise ValueError(f"cannot decode image {name}: corrupt or truncated ({e})") from None


def _decode_rgbx(im: Image.Image, name: str) -> torch.Tensor | None:
    """An upright RGB JPEG decoded straight into a recycled [H, W, 4] buffer: its [3, H, W]
    view (4-byte pixels, the 4th byte unused). None when the image does not qualify or
    Pillow's interface has changed (then it is decoded the portable way).

    NOTE: Pillow keeps RGB as 4-byte pixels. Decoding into memory it owns and then packing
    it to 3 bytes costs a pass over the image (73 ms of 580 for the benchmark's 16 JPEGs);
    here the decoder writes into mmferry's buffer, which resize_u8 and the patch kernel read
    as it is. Only JPEG, whose loader fills the image memory it is given.
    """
    if im.format != "JPEG" or im.mode != "RGB" or im.info.get("transparency") is not None:
        return None
    if _orientation(im) != 1:
        return None
    buf = empty_host((im.height, im.width, 4), torch.uint8)
    try:
        core = Image.core.map_buffer(buf.numpy(), im.size, "raw", 0, ("RGB", 0, 1))
        im.im = core
    except (AttributeError, TypeError, ValueError):
        return None
    _load(im, name)
    if im.im is not core:  # Pillow made its own memory: take the pixels from there
        return None
    return buf.permute(2, 0, 1)[:3]


def _upright(im: Image.Image) -> Image.Image:
    """The pixels as shown: turned by the EXIF orientation (a copy only when it turns)."""
    # NOTE: the same turn as transformers' ImageOps.exif_transpose, without its rewrite of the
    # EXIF block (only the pixels are used here): that rewrite re-encodes every tag and fails
    # (TypeError, struct.error) on a valid image whose unrelated numeric tag is stored as text.
    orientation = _orientation(im)
    return im if orientation == 1 else im.transpose(_UPRIGHT[orientation])


def _to_rgb(im: Image.Image) -> Image.Image:
    if im.mode == "RGB":
        return im
    if im.mode in ("La", "RGBa"):
        # Premultiplied alpha: Pillow converts these only to their straight-alpha mode.
        im = im.convert(im.mode[:-1] + "A")
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return im.convert("RGB")


def _high_bit_scale(im: Image.Image, name: str) -> float | None:
    """The factor that maps a high-bit greyscale image onto 0..255; None for other modes."""
    if im.mode.startswith("I;16"):
        return 255 / 65535
    if im.mode not in ("I", "F"):
        return None
    lo, hi = im.getextrema()
    if im.mode == "I" and lo >= 0 and hi <= 65535:
        return 255 / 65535  # 16-bit samples (how some decoders store 16-bit greyscale)
    if im.mode == "F" and lo >= 0 and hi <= 1:
        return 255.0
    kind = "32-bit integer" if im.mode == "I" else "float"
    want = "0..65535" if im.mode == "I" else "0..1"
    raise ValueError(
        f"image {name} has {kind} greyscale pixels in {lo}..{hi}; only {want} can be scaled "
        "to 8 bits without guessing their range: convert it to 8 bits first"
    )


def _copy_rgbx(im: Image.Image) -> torch.Tensor | None:
    """A decoded RGB image's pixels copied as they lie in Pillow's memory (4-byte pixels) into
    a recycled [H, W, 4] buffer: its [3, H, W] view, as `_decode_rgbx` gives. None when
    Pillow's interface has changed (then the pixels are packed to 3 bytes).

    NOTE: Pillow's paste between two images of one mode copies each line with memcpy, where
    packing to 3-byte pixels shuffles every pixel: 16 PIL images of 48 MP took 38-40 ms of CPU
    here against 83-93 ms (docs/benchmarks/preprocess-intel.md). resize_u8 and the patch
    kernel read 4-byte pixels as they are.
    """
    buf = empty_host((im.height, im.width, 4), torch.uint8)
    try:
        core = Image.core.map_buffer(buf.numpy(), im.size, "raw", 0, ("RGB", 0, 1))
        core.paste(im.im, (0, 0, im.width, im.height))
    except Exception:  # noqa: BLE001 - any change in Pillow's internals: fall back
        return None
    return buf.permute(2, 0, 1)[:3]


def _pack_rgb(im: Image.Image) -> np.ndarray | None:
    """RGB pixels packed straight into a writable [H, W, 3] array, in one pass.

    `np.asarray(im)` goes through `tobytes()`, which packs into 64 KiB chunks and then joins
    them: two passes over the image. Here each chunk is copied out while still in cache.
    Relies on Pillow's raw encoder interface; None (use the portable path) if it changes.
    """
    try:
        out = empty_host((im.height, im.width, 3), torch.uint8).numpy()
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


def _convert_in_strips(im: Image.Image, name: str) -> np.ndarray:
    """Any other mode -> [H, W, 3] uint8, converted a strip of rows at a time."""
    scale = _high_bit_scale(im, name)
    out = np.empty((im.height, im.width, 3), np.uint8)
    rows = max(1, _STRIP_PIXELS // im.width)
    for y in range(0, im.height, rows):
        strip = im.crop((0, y, im.width, min(im.height, y + rows)))
        if scale is None:
            out[y : y + rows] = np.asarray(_to_rgb(strip))
        else:
            grey = np.asarray(strip).astype(np.float32) * scale
            out[y : y + rows] = np.rint(grey).astype(np.uint8)[..., None]
    return out


def _pil_to_chw(im: Image.Image, name: str) -> torch.Tensor:
    hwc = None
    if im.mode == "RGB" and im.info.get("transparency") is None:
        rgbx = _copy_rgbx(im)
        if rgbx is not None:
            return rgbx
        hwc = _pack_rgb(im)
        if hwc is None:
            hwc = np.array(im)  # [H, W, 3] uint8, writable
    else:
        hwc = _convert_in_strips(im, name)
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


def without_negative_strides(arr: np.ndarray) -> np.ndarray:
    """`arr` with no negative stride: a view when only axes of length 1 are flipped."""
    # NOTE: the stride of an axis of length 1 never addresses memory, so numpy counts a1[::-1]
    # as contiguous and np.ascontiguousarray returns it unchanged, negative stride and all.
    # Such a stride is set to 0 without a copy; a flip of a longer axis needs the copy.
    if min(arr.strides, default=0) >= 0:
        return arr  # as given (a read-only view would make torch warn on every frame list)
    strides = tuple(0 if n == 1 else s for n, s in zip(arr.shape, arr.strides))
    if min(strides) < 0:
        return np.array(arr, order="C")  # a fresh array: positive strides only
    return np.lib.stride_tricks.as_strided(arr, strides=strides, writeable=False)


class PackedRGB(ChunkedPart):
    """The bytes of [H, W, 3] RGB pixels held 4 bytes a pixel, packed to 3 a chunk at a time
    as they are hashed: the same bytes as `pixels.contiguous()`, without torch's strided copy
    of the whole image. The benchmark's 16 images (48 MP), one thread: that copy 116-137 ms of
    CPU, the packed chunks 29-33 ms; packed and hashed 50-53 ms, where a chunk is hashed from
    L2 (docs/benchmarks/preprocess-intel.md)."""

    CHUNK_BYTES = 1 << 20  # stays in L2 between the pack and the hash

    def __init__(self, pixels: torch.Tensor) -> None:
        self.pixels = pixels
        self.nbytes = pixels.numel()

    def chunks(self) -> Iterator[memoryview]:
        h, w, _ = self.pixels.shape
        rows = max(1, self.CHUNK_BYTES // (3 * w))
        buf = np.empty(min(rows, h) * 3 * w, np.uint8)
        view = memoryview(buf)
        src, stride = self.pixels.data_ptr(), self.pixels.stride(0)
        for y in range(0, h, rows):
            n = min(rows, h - y)
            kernels.pack_rgb(src + y * stride, stride, w, n, buf.ctypes.data)
            yield view[: n * 3 * w]


def _rgbx_hwc(pixels: torch.Tensor) -> bool:
    """Whether `pixels` [H, W, 3] uint8 are RGB held in 4-byte pixels (rows of any stride)."""
    if pixels.dim() != 3 or pixels.dtype != torch.uint8 or pixels.shape[-1] != 3:
        return False
    h, w, _ = pixels.shape
    return (
        pixels.device.type == "cpu"
        and pixels.stride(2) == 1
        and pixels.stride(1) == 4
        and pixels.stride(0) >= 4 * w
        and h * w > 0
    )


def pixels_identity(
    pixels: torch.Tensor, kind: bytes
) -> tuple[bytes | memoryview | ChunkedPart, ...]:
    """Hash parts for raw pixels: kind, shape and the bytes (a view when contiguous; RGB in
    4-byte pixels packed a chunk at a time by the compiled kernel, when it is built)."""
    shape = ",".join(str(s) for s in pixels.shape).encode()
    if _rgbx_hwc(pixels) and kernels.available():
        return (kind, shape, PackedRGB(pixels))
    return (kind, shape, memoryview(pixels.contiguous().numpy()).cast("B"))


def as_batch(chw: torch.Tensor) -> torch.Tensor:
    """[3, H, W] -> [1, 3, H, W]; channels-last strides when `chw` is a view of HWC memory.

    `chw.unsqueeze(0)` would give a batch stride of 3, which torch does not recognise as
    channels-last, so its resize takes the slow planar uint8 kernel.
    """
    return chw.permute(1, 2, 0).unsqueeze(0).permute(0, 3, 1, 2)


def decode_image(source: Any, max_pixels: int) -> DecodedImage:
    """Decode any supported image source; ValueError naming the source when it cannot."""
    name = describe(source)
    if isinstance(source, np.ndarray):
        _check_array(source, name, "HWC")
        # NOTE: a strided array (a CHW buffer seen as HWC) is used as it lies: the resize makes
        # it channels-last with torch's copy, faster than numpy's. torch takes no negative
        # strides (flipped views), so only those are undone here.
        if min(source.strides) < 0:
            source = without_negative_strides(source)
        with warnings.catch_warnings():
            # Read-only arrays (np.asarray of a PIL image) are common; mmferry only reads them.
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            t = torch.from_numpy(source)
        return DecodedImage(_array_to_chw(t, name), None)
    if isinstance(source, torch.Tensor):
        _check_array(source, name, "CHW")
        t = source.detach().cpu()
        if t.shape[0] not in (1, 3, 4) and t.shape[-1] in (1, 3, 4):
            raise ValueError(f"image {name} looks channels-last; tensors must be CHW")
        return DecodedImage(_array_to_chw(t.permute(1, 2, 0), name), None)
    if isinstance(source, Image.Image):
        if source.width * source.height > max_pixels:
            raise ValueError(f"image {name} exceeds max_decoded_pixels={max_pixels}")
        # NOTE: no identity: orientation and a transparency key change the upright pixels,
        # so the key is taken over the upright pixels (image.py), which covers both.
        _load(source, name)  # a lazily opened file: its decode errors name it
        return DecodedImage(_pil_to_chw(_upright(source), name), None)
    data = read_source_bytes(source)
    if data is None:
        raise ValueError(
            f"unsupported image source {name}; pass a path, bytes, a binary file, a PIL image, "
            "an HWC uint8 numpy array or a CHW uint8 torch tensor"
        )
    im = _open_checked(data, name, max_pixels)
    pixels = _decode_rgbx(im, name)
    if pixels is None:
        _load(im, name)
        pixels = _pil_to_chw(_upright(im), name)  # the unturned image is dropped
    return DecodedImage(pixels, encoded_identity(data))
