"""Inputs that used to crash, lie or balloon: each is a clear ValueError or a correct result.

Peak memory is measured in a fresh subprocess: its peak RSS (VmHWM) is reset after the imports
(`/proc/self/clear_refs`), so the test sees what one call really holds.
"""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import textwrap
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

from mmferry.models import preset
from mmferry.preprocess.image import process_image
from mmferry.preprocess.sampling import frame_timestamps
from mmferry.preprocess.video import process_video, sample_indices

from . import reference as ref
from .conftest import encode, gradient

CFG = preset("qwen3-vl")
ROOT = Path(__file__).resolve().parents[2]


def _peak_growth_mib(code: str, setup: str = "") -> float:
    """Peak RSS growth (MiB) of `code`, run in a fresh interpreter after `setup` and imports."""
    script = textwrap.dedent(
        """
        import io, json, sys
        import numpy as np
        from PIL import Image
        from mmferry.models import preset
        from mmferry.preprocess.image import process_image
        from mmferry.preprocess.video import process_video
        process_image(np.zeros((64, 64, 3), np.uint8), preset("qwen3-vl"))  # warm-up
        data = open(sys.argv[1], "rb").read()
        {setup}
        def status(key):
            for line in open("/proc/self/status"):
                if line.startswith(key + ":"):
                    return int(line.split()[1])  # KiB
        open("/proc/self/clear_refs", "w").write("5")  # peak RSS := current RSS
        before = status("VmRSS")
        {code}
        print(json.dumps((status("VmHWM") - before) / 1024))
        """
    ).format(setup=setup, code=code)
    return script


def _run(script: str, data_path: Path) -> float:
    out = subprocess.run(
        [sys.executable, "-c", script, str(data_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "MMFERRY_PREPROCESS_THREADS": "1", "PATH": "/usr/bin"},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _black_h264(path: Path, frames: int, width: int, height: int, fps: int) -> None:
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast"}
        yuv = np.full((height * 3 // 2, width), 128, np.uint8)
        yuv[:height] = 16
        for _ in range(frames):
            for pkt in stream.encode(av.VideoFrame.from_ndarray(yuv, format="yuv420p")):
                out.mux(pkt)
        for pkt in stream.encode():
            out.mux(pkt)


def test_video_memory_bomb_is_bounded(tmp_path):
    """40 black 4096x2160 frames (a few KB) sampled to 20: frames are resized as decoded.

    Holding the 20 decoded frames alone takes 20 x 25.3 MiB = 506 MiB (the whole call peaked
    at 692 MiB). Resized as decoded, the call holds the resized clip and its features
    (qwen3-vl's 25 M pixel budget: 2 x 71 MiB), one decoded frame with its resize buffers
    (about 4 x 25 MiB) and the decoder's frames: under 400 MiB, whatever the clip's length.
    """
    path = tmp_path / "bomb.mp4"
    _black_h264(path, 40, 4096, 2160, 4)
    assert path.stat().st_size < 200_000
    growth = _run(
        _peak_growth_mib('item = process_video(data, preset("qwen3-vl"), layout="compact-u8")'),
        path,
    )
    assert growth < 400, f"peak grew by {growth:.0f} MiB"


def _bilevel_png(width: int, height: int) -> bytes:
    return encode(Image.new("1", (width, height), 0), "PNG", optimize=True)


def test_image_decode_peak_is_bounded(tmp_path):
    """A small 1-bit PNG of 36 M pixels: converted in strips, never as a whole RGB(A) image.

    Bound: 4 bytes per pixel (Pillow's 1-byte image + one packed RGB array) + 64 MiB.
    """
    data = _bilevel_png(6000, 6000)
    assert len(data) < 64_000
    path = tmp_path / "bilevel.png"
    path.write_bytes(data)
    code = (
        'process_image(data, preset("qwen3-vl").replace(image_max_pixels=1 << 20), '
        'layout="compact-u8")'
    )
    growth = _run(_peak_growth_mib(code), path)
    assert growth < 4 * 36e6 / 2**20 + 64, f"peak grew by {growth:.0f} MiB"


def _jpeg_declaring(width: int, height: int) -> bytes:
    """A tiny JPEG whose frame header claims width x height."""
    data = bytearray(encode(Image.fromarray(gradient(16, 16)), "JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def test_header_checked_against_the_decode_budget():
    """100 M RGB pixels pass the pixel limit but would hold ~700 MiB: refused from the header."""
    bomb = _jpeg_declaring(10_000, 10_000)
    assert len(bomb) < 1000
    with pytest.raises(ValueError, match=r"RGB 10000x10000\) needs about 667 MiB .* 512 MiB"):
        process_image(bomb, CFG)


def test_unknown_video_codec(tmp_path):
    buf = io.BytesIO()
    with av.open(buf, "w", format="avi") as out:
        stream = out.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for f in ref.moving_frames(3, 48, 64):
            for pkt in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(pkt)
        for pkt in stream.encode():
            out.mux(pkt)
    data = buf.getvalue()
    assert data.count(b"FMP4") == 2
    with pytest.raises(ValueError, match=r"codec .*not supported"):
        process_video(data.replace(b"FMP4", b"QQQQ"), CFG)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fps": float("nan")}, r"fps must be finite"),
        ({"fps": float("inf")}, r"fps must be finite"),
        ({"fps": -1.0}, r"fps must be positive"),
        ({"num_frames": 2.5}, r"num_frames must be a whole number"),
        ({"num_frames": "8"}, r"num_frames must be a number"),
        ({"source_fps": 1e-300}, r"source_fps must be a frame rate between"),
        ({"source_fps": float("nan")}, r"source_fps must be finite"),
    ],
)
def test_bad_rates_and_counts(kwargs, match, tmp_path):
    frames = ref.moving_frames(8, 32, 32)
    with pytest.raises(ValueError, match=match):
        process_video(frames, CFG, **{"source_fps": 4.0, **kwargs})
    with pytest.raises(ValueError, match=match):
        sample_indices(
            CFG,
            8,
            kwargs.get("source_fps", 4.0),
            fps=kwargs.get("fps"),
            num_frames=kwargs.get("num_frames"),
        )


def test_whole_float_num_frames_is_accepted():
    frames = ref.moving_frames(8, 32, 32)
    a = process_video(frames, CFG, layout="compact-u8", source_fps=4, num_frames=4.0)
    b = process_video(frames, CFG, layout="compact-u8", source_fps=4, num_frames=4)
    assert torch.equal(a.feature, b.feature) and a.grid_thw == b.grid_thw


VFR_TIMES_MS = [0, 50, 100, 150, 700, 1300, 1350, 1400, 2500, 2550, 2600, 4000]


def _vfr_video(path: Path) -> None:
    frames = ref.moving_frames(len(VFR_TIMES_MS), 48, 64, seed=5)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.time_base = Fraction(1, 1000)
        stream.codec_context.time_base = Fraction(1, 1000)
        for f, ms in zip(frames, VFR_TIMES_MS):
            frame = av.VideoFrame.from_ndarray(f, format="rgb24")
            frame.pts, frame.time_base = ms, Fraction(1, 1000)
            for pkt in stream.encode(frame):
                out.mux(pkt)
        for pkt in stream.encode():
            out.mux(pkt)


def test_variable_frame_rate_timestamps_are_the_frames_own(tmp_path):
    path = tmp_path / "vfr.mkv"
    _vfr_video(path)
    with av.open(str(path)) as c:
        own = [float(f.pts * f.time_base) for f in c.decode(video=0)]
    assert own == pytest.approx([ms / 1000 for ms in VFR_TIMES_MS])
    item = process_video(path, CFG, layout="compact-u8", num_frames=6)
    indices = sample_indices(CFG, len(own), 1.0, num_frames=6)
    want = [(own[a] + own[b]) / 2 for a, b in zip(indices[::2], indices[1::2])]
    assert item.timestamps == pytest.approx(want, abs=1e-9)
    # The index / average-rate rule puts these frames elsewhere.
    assert frame_timestamps(indices, len(own) / 4.0, 2) != pytest.approx(want, abs=0.05)


def _grey16_png(values: np.ndarray) -> bytes:
    return encode(Image.fromarray(values.astype(np.uint16)), "PNG")


def test_16_bit_greyscale_is_scaled_not_clipped():
    rng = np.random.default_rng(0)
    v16 = rng.integers(0, 65536, (96, 128), dtype=np.uint16)
    data = _grey16_png(v16)
    assert Image.open(io.BytesIO(data)).mode.startswith("I;16")
    want8 = np.rint(v16.astype(np.float64) * 255 / 65535).astype(np.uint8)
    got = process_image(data, CFG, layout="compact-u8")
    assert torch.equal(
        got.feature, process_image(want8[..., None], CFG, layout="compact-u8").feature
    )
    assert 0 < got.feature.float().mean() < 255  # neither all white nor all black


def test_32_bit_and_float_greyscale():
    small = np.arange(96 * 128, dtype=np.int32).reshape(96, 128) * 5  # within 0..65535
    got = process_image(Image.fromarray(small, mode="I"), CFG, layout="compact-u8")
    want8 = np.rint(small * 255 / 65535).astype(np.uint8)[..., None]
    assert torch.equal(got.feature, process_image(want8, CFG, layout="compact-u8").feature)
    with pytest.raises(ValueError, match=r"32-bit integer greyscale .* convert it to 8 bits"):
        process_image(Image.fromarray(small * 1000, mode="I"), CFG)
    unit = np.linspace(0, 1, 96 * 128, dtype=np.float32).reshape(96, 128)
    tiff = encode(Image.fromarray(unit, mode="F"), "TIFF")
    got = process_image(tiff, CFG, layout="compact-u8")
    want8 = np.rint(unit.astype(np.float32) * np.float32(255)).astype(np.uint8)[..., None]
    assert torch.equal(got.feature, process_image(want8, CFG, layout="compact-u8").feature)
    with pytest.raises(ValueError, match=r"float greyscale pixels in .* 0\.\.1"):
        process_image(Image.fromarray(unit * 300, mode="F"), CFG)


def test_animated_image_uses_its_first_frame():
    first = Image.fromarray(gradient(64, 96, 1))
    second = Image.fromarray(gradient(64, 96, 2)[::-1].copy())
    data = encode(first, "PNG", save_all=True, append_images=[second])
    assert getattr(Image.open(io.BytesIO(data)), "n_frames", 1) == 2
    item = process_image(data, CFG)
    want, _ = ref.image_hf(ref.load_rgb(data), CFG)  # transformers loads the first frame
    torch.testing.assert_close(item.feature, want, atol=1e-5, rtol=0)
    assert torch.equal(item.feature, process_image(np.array(first), CFG).feature)
    assert not torch.equal(item.feature, process_image(np.array(second), CFG).feature)
