"""Images for the preprocessing tests, generated deterministically (no downloads)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image


def gradient(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A smooth colour field with mild noise, [h, w, 3] uint8."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([xx / max(w - 1, 1), yy / max(h - 1, 1), (xx + yy) / max(h + w - 2, 1)], -1)
    img = 255 * base + rng.normal(0, 6, (h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.fixture(scope="session")
def odd_images() -> dict[str, bytes]:
    """Encoded images of awkward sizes and modes."""
    rgb = Image.fromarray(gradient(301, 457, 1))
    rgba = Image.fromarray(gradient(123, 77, 2)).convert("RGBA")
    alpha = np.tile(np.linspace(0, 255, 77, dtype=np.uint8), (123, 1))
    rgba.putalpha(Image.fromarray(alpha))
    palette = Image.fromarray(gradient(90, 140, 3)).convert("P", palette=Image.Palette.ADAPTIVE)
    palette.info["transparency"] = 5
    exif_img = Image.fromarray(gradient(200, 120, 4))
    exif = exif_img.getexif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise when shown
    return {
        "rgb_jpeg_odd": encode(rgb, "JPEG", quality=92),
        "thin_png": encode(Image.fromarray(gradient(9, 700, 5)), "PNG"),
        "tall_png": encode(Image.fromarray(gradient(1500, 31, 6)), "PNG"),
        "rgba_png": encode(rgba, "PNG"),
        "palette_png": encode(palette, "PNG"),
        "gray_png": encode(Image.fromarray(gradient(64, 99, 7)[..., 0]), "PNG"),
        "la_png": encode(Image.fromarray(gradient(50, 60, 8)[..., 0]).convert("LA"), "PNG"),
        "exif_jpeg": encode(exif_img, "JPEG", quality=95, exif=exif),
        "big_jpeg": encode(Image.fromarray(gradient(1100, 1700, 9)), "JPEG", quality=90),
    }
