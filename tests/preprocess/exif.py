"""EXIF blocks built byte by byte, for images whose metadata Pillow reads but cannot rewrite."""

from __future__ import annotations

import struct

SHORT, ASCII = 3, 2
ORIENTATION, X_RESOLUTION, IMAGE_WIDTH, RESOLUTION_UNIT = 0x0112, 0x011A, 0x0100, 0x0128


def exif_block(*entries: tuple[int, int, bytes]) -> bytes:
    """A big-endian EXIF block of one IFD; each entry is (tag, type, 4-byte value field)."""
    ifd = struct.pack(">H", len(entries))
    for tag, kind, value in entries:
        count = 1 if kind == SHORT else len(value)
        ifd += struct.pack(">HHI", tag, kind, count) + value
    return b"Exif\0\0MM\0*" + struct.pack(">I", 8) + ifd + bytes(4)


def orientation(value: int) -> tuple[int, int, bytes]:
    return (ORIENTATION, SHORT, struct.pack(">HH", value, 0))


def as_text(tag: int) -> tuple[int, int, bytes]:
    """`tag` (numeric in the standard) stored as the text "abc"."""
    return (tag, ASCII, b"abc\0")
