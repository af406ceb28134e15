"""The compiled patch-row kernel gives the torch path's rows bit for bit, for every geometry,
frame grouping, row stride and thread count (the bands really split over the threads), and
declines frames it cannot read."""

from __future__ import annotations

import pytest
import torch

from mmferry.preprocess import kernels
from mmferry.preprocess import patchify as patchify_mod
from mmferry.preprocess import threads as threads_mod
from mmferry.preprocess.patchify import norm_affine, patchify
from mmferry.preprocess.threads import run_split

MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def test_the_install_built_the_kernel():
    # `pip install` builds it wherever a C compiler is present, as on every test machine.
    assert kernels.available()


def _hwc_frames(n: int, h: int, w: int, seed: int, pad: int = 0, pixel: int = 3) -> torch.Tensor:
    """[n, 3, h, w] uint8 views of HWC memory of `pixel` bytes a pixel; `pad` extra pixels per
    row (a crop's stride)."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randint(0, 256, (n, h + 1, w + pad, pixel), dtype=torch.uint8, generator=g)
    return full[:, 1:, pad // 2 : pad // 2 + w, :3].permute(0, 3, 1, 2)


def _torch_path(monkeypatch, frames, **kw) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(patchify_mod, "patch_rows", lambda *a, **k: False)
        return patchify(frames, **kw)


# Every path this CPU runs (the AVX-512 one where it has AVX-512 with VBMI, the portable one
# everywhere), the AVX-512 one with normal and with non-temporal stores.
PATHS = [(0, False)] + [
    (level, stream) for level in (1,) if kernels.isa() >= level for stream in (False, True)
]


@pytest.mark.parametrize(("level", "stream"), PATHS)
@pytest.mark.parametrize("pixel", [3, 4])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize(
    ("n", "h", "w", "patch", "pad"),
    [
        (1, 28, 28, 14, 0),
        (1, 56, 168, 14, 5),
        (1, 320, 96, 16, 0),
        (2, 64, 32, 16, 3),
        (4, 96, 160, 16, 0),
        (6, 56, 84, 14, 1),
    ],
)
def test_kernel_equals_torch_path(monkeypatch, n, h, w, patch, pad, threads, pixel, level, stream):
    # Every geometry here writes less than an item needs to be split over threads: lower
    # that size, so that threads=3 does split the bands (and the torch path's ranges).
    monkeypatch.setattr(threads_mod, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(kernels, "isa", lambda: level)
    monkeypatch.setattr(kernels, "STREAM_MIN_BYTES", 0 if stream else 1 << 62)
    parts: list[int] = []

    def recorded(n_items: int, n_threads: int, work) -> None:
        parts.append(max(1, min(n_threads, n_items)))
        run_split(n_items, n_threads, work)

    monkeypatch.setattr(kernels, "run_split", recorded)
    frames = _hwc_frames(n, h, w, seed=n * 100 + h + w, pad=pad, pixel=pixel)
    assert kernels._hwc_strides(frames) is not None  # the kernel path is the one taken
    image = n == 1
    bands = (n if image else n // 2) * (h // (patch * 2))
    kw = dict(image=image, patch=patch, merge=2, temporal=2, mean=MEAN, std=STD, threads=threads)
    for layout in ("hf", "compact-u8"):
        parts.clear()
        got = patchify(frames, layout=layout, **kw)
        assert parts == [min(threads, bands)]  # the kernel ran, over this many ranges
        want = _torch_path(monkeypatch, frames, layout=layout, **kw)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want), (layout, n, h, w, patch, pad, pixel, level, stream)


def test_the_kernel_takes_the_widest_path_this_cpu_has():
    """The run-time dispatch: AVX-512 with VBMI where the CPU reports it (one build for
    every x86-64 CPU), else the portable path."""
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    wanted = {"avx512f", "avx512bw", "avx512vl", "avx512vbmi"}
    assert kernels.isa() == (1 if wanted <= flags else 0)


def test_kernel_declines_what_it_cannot_read():
    planar = torch.zeros(1, 3, 32, 32, dtype=torch.uint8)  # CHW memory, not HWC
    hwc = planar.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    out = torch.full((4, 3 * 16 * 16), 7, dtype=torch.uint8)
    geometry = dict(group=1, temporal=1, patch=16, merge=2, affine=None, threads=1)
    assert not kernels.patch_rows(planar, out, **geometry)
    assert not kernels.patch_rows(hwc.float(), out, **geometry)
    assert not kernels.patch_rows(hwc, out.t(), **geometry)  # output not contiguous
    assert (out == 7).all()
    assert kernels.patch_rows(hwc, out, **geometry)
    assert (out == 0).all()
    rows = torch.empty(4, 3 * 2 * 16 * 16)
    affine = norm_affine(MEAN, STD)
    assert kernels.patch_rows(hwc, rows, **{**geometry, "temporal": 2, "affine": affine})
    shift = affine[1].view(1, 3, 1, 1).expand(4, 3, 2, 256)
    assert torch.equal(rows.view(4, 3, 2, 256), shift)  # black pixels: the shift alone


def test_rgb_in_four_byte_pixels_resizes_like_packed_rgb():
    """RGB views of 4-byte pixels resize as four channels (the same RGB bits as packed RGB);
    a view whose storage ends before the last pixel's 4th byte is not widened past it."""
    g = torch.Generator().manual_seed(4)
    h, w = 61, 83
    full = torch.randint(0, 256, (4 * h * w,), dtype=torch.uint8, generator=g)
    for storage in (full, full[:-1].clone()):  # room for the 4th byte, then not
        rgb = storage.as_strided((1, 3, h, w), (4 * h * w, 1, 4 * w, 4))
        packed = rgb.contiguous(memory_format=torch.channels_last)
        for size in ((64, 96), (32, 32), (h, w)):
            got = patchify_mod.resize_u8(rgb, *size)
            assert torch.equal(got, patchify_mod.resize_u8(packed, *size)), size
    assert (
        patchify_mod._rgbx_view(
            full[:-1].clone().as_strided((1, 3, h, w), (4 * h * w, 1, 4 * w, 4))
        )
        is None
    )
    widened = patchify_mod._rgbx_view(full.as_strided((1, 3, h, w), (4 * h * w, 1, 4 * w, 4)))
    assert widened is not None and widened.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("level", [lvl for lvl in (0, 1) if kernels.isa() >= lvl])
@pytest.mark.parametrize(
    ("h", "w", "pad"), [(1, 1, 0), (3, 15, 1), (2, 16, 0), (5, 17, 3), (4, 400, 7)]
)
def test_pack_rgb_equals_a_contiguous_copy(level, h, w, pad):
    """RGB held in 4-byte pixels (rows `pad` pixels apart beyond the row) packed to 3 bytes a
    pixel: torch's contiguous copy, byte for byte, the row tails included, nothing written past
    the rows."""
    g = torch.Generator().manual_seed(h * 1000 + w)
    full = torch.randint(0, 256, (h, w + pad, 4), dtype=torch.uint8, generator=g)
    pixels = full[:, :w, :3]
    out = torch.full((h * w * 3 + 64,), 0xA5, dtype=torch.uint8)
    assert kernels.pack_rgb(pixels.data_ptr(), pixels.stride(0), w, h, out.data_ptr(), level=level)
    assert torch.equal(out[: h * w * 3], pixels.contiguous().view(-1))
    assert bool((out[h * w * 3 :] == 0xA5).all())
