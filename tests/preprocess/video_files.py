"""Video files with awkward containers, built with PyAV, and what a full decode makes of them.

A full PyAV decode, independent of mmferry's seek path, is the oracle for which frame index i
is and when it is shown. `SeekLog` records how mmferry's decoder read a file, so tests can
assert that the seek path itself succeeded, not its fallback.
"""

from __future__ import annotations

import io
import struct
from fractions import Fraction
from typing import Any

import av
import numpy as np
import pytest

from mmferry.preprocess import video_decode

# MP4 boxes that only hold other boxes, on the way from the file to a track's sample tables.
_CONTAINERS = {b"moov", b"trak", b"edts", b"mdia", b"minf", b"stbl"}


def write_video(
    codec: str,
    frames: np.ndarray,
    *,
    fmt: str = "mp4",
    rate: int = 30,
    gop: int = 12,
    first_pts: int = 0,
) -> bytes:
    """[n, H, W, 3] uint8 frames encoded with `codec`, a keyframe every `gop` frames.

    Frame i is stamped (first_pts + i) / rate: a negative `first_pts` makes the MP4 muxer write
    an edit list that starts the presentation at time 0, discarding the frames before it (the
    file `ffmpeg -ss ... -c copy` writes).
    """
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        stream.codec_context.gop_size = gop
        if codec == "libx264":
            stream.options = {"bf": "2", "preset": "ultrafast", "keyint_min": str(gop)}
        for i, f in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(f, format="rgb24")
            frame.pts, frame.time_base = first_pts + i, Fraction(1, rate)
            for pkt in stream.encode(frame):
                container.mux(pkt)
        for pkt in stream.encode():
            container.mux(pkt)
    return out.getvalue()


def find_box(data: bytes, path: list[bytes]) -> tuple[int, int] | None:
    """(offset, size) of the first box at `path` (e.g. [b"moov", b"trak", b"edts"]), or None."""
    start, end = 0, len(data)
    for depth, name in enumerate(path):
        off = start
        while off + 8 <= end:
            size, kind = struct.unpack(">I4s", data[off : off + 8])
            if size < 8:  # 0 (to the end) and 1 (64-bit sizes) are not written by these tests
                raise ValueError(f"unexpected MP4 box size {size} at {off}")
            if kind == name:
                break
            off += size
        else:
            return None
        if depth == len(path) - 1:
            return off, size
        assert name in _CONTAINERS, name
        start, end = off + 8, off + size
    return None


def rename_box(data: bytes, path: list[bytes], new: bytes) -> bytes:
    """`data` with the box at `path` renamed (to b"free", a demuxer skips it; sizes stay)."""
    found = find_box(data, path)
    assert found is not None, f"no {path} box"
    off = found[0]
    return data[: off + 4] + new + data[off + 8 :]


def edit_list(data: bytes) -> list[tuple[int, int]]:
    """The first track's edit list as (segment duration, media time) entries."""
    found = find_box(data, [b"moov", b"trak", b"edts", b"elst"])
    if found is None:
        return []
    off = found[0]
    version, count = data[off + 8], struct.unpack(">I", data[off + 12 : off + 16])[0]
    entry = ">QqI" if version == 1 else ">IiI"
    width = struct.calcsize(entry)
    first = off + 16
    return [
        struct.unpack(entry, data[first + k * width : first + (k + 1) * width])[:2]
        for k in range(count)
    ]


def full_decode(data: bytes) -> tuple[np.ndarray, list[float]]:
    """Every frame a plain decode yields, [n, H, W, 3] uint8, and its presentation time (s)."""
    with av.open(io.BytesIO(data)) as container:
        decoded = [(f.to_ndarray(format="rgb24"), f.time) for f in container.decode(video=0)]
    return np.stack([f for f, _ in decoded]), [t for _, t in decoded]


class _Container:
    """A PyAV container whose seeks are recorded (its own methods are read-only)."""

    def __init__(self, container: Any, seeks: list[tuple[Any, ...]]) -> None:
        self.container, self.seeks = container, seeks

    def seek(self, *args: Any, **kwargs: Any) -> Any:
        self.seeks.append(args)
        return self.container.seek(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.container, name)

    def __enter__(self) -> _Container:
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self.container.__exit__(*exc)


class SeekLog:
    """Records how the video decoder reads files: each decode (with the probe's seek table, or
    from the start: the fallback when the seek path misses) and each seek."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.decodes: list[str] = []
        self.seeks: list[tuple[Any, ...]] = []
        real_open, real_decode = video_decode._open, video_decode._decode

        def recording_open(av_mod: Any, data: bytes, name: str) -> tuple[Any, Any]:
            container, stream = real_open(av_mod, data, name)
            return _Container(container, self.seeks), stream

        def recording_decode(*args: Any) -> Any:
            info = args[-1]
            self.decodes.append("seek table" if info is not None else "from the start")
            return real_decode(*args)

        monkeypatch.setattr(video_decode, "_open", recording_open)
        monkeypatch.setattr(video_decode, "_decode", recording_decode)

    def assert_seek_path_succeeded(self, min_seeks: int = 1) -> None:
        assert self.decodes == ["seek table"], self.decodes
        assert len(self.seeks) >= min_seeks, f"{len(self.seeks)} seek(s)"
