"""Resized uint8 frames -> patch rows in merge-block order, in the hf or compact-u8 layout.

Row order (both layouts, images and videos) is transformers' Qwen-VL order: temporal patch,
then merge block (row-major), then the m x m patches inside the block. Row contents are
`[C][T][P][P]` (hf, and compact-u8 videos) or `[C][P][P]` (compact-u8 images).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmferry.preprocess.buffers import empty_host
from mmferry.preprocess.kernels import patch_rows
from mmferry.preprocess.threads import run_split, threads_for


def resize_u8(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[F, C, H, W] uint8 -> [F, C, height, width] uint8, antialiased bicubic.

    torch's native uint8 antialiased bicubic kernel is the one torchvision (and so transformers'
    default Qwen-VL processors) runs on CPU for uint8 input; an unchanged size is returned as is.
    Input in channels-last memory (HWC frames) takes torch's fast vectorised uint8 kernel;
    other strides are made channels-last first (one copy, cheaper than the planar kernel).
    The output is the same bit for bit either way, channels-last, in a recycled host buffer.
    """
    if tuple(frames.shape[-2:]) == (height, width):
        return frames
    rgbx = _rgbx_view(frames)
    if rgbx is not None:
        # RGB in 4-byte pixels (a decoded JPEG, see decode.py): resize all four channels, which
        # is torch's native layout for this kernel, and hand on the RGB view.
        return resize_u8(rgbx, height, width)[:, :3]
    f, c, h, w = frames.shape
    if not frames.is_contiguous(memory_format=torch.channels_last):
        hwc = empty_host((f, h, w, c), torch.uint8).permute(0, 3, 1, 2)
        frames = hwc.copy_(frames)
    out = empty_host((f, height, width, c), torch.uint8).permute(0, 3, 1, 2)
    try:
        # NOTE: the out= form of the op F.interpolate calls, so that the output lands in a
        # recycled buffer (buffers.py) instead of fresh pages.
        return _upsample_aa(frames, [height, width], False, None, None, out=out)
    except (AttributeError, RuntimeError, TypeError):  # the private op changed: portable path
        return F.interpolate(
            frames, size=(height, width), mode="bicubic", antialias=True, align_corners=False
        )


_upsample_aa = getattr(torch._C._nn, "_upsample_bicubic2d_aa", None)


def _rgbx_view(frames: torch.Tensor) -> torch.Tensor | None:
    """[F, 4, H, W] channels-last over the same memory when `frames` [F, 3, H, W] is the RGB
    part of contiguous 4-byte pixels; else None."""
    f, c, h, w = frames.shape
    if c != 3 or frames.stride() != (4 * h * w, 1, 4 * w, 4):
        return None
    end = frames.storage_offset() + 4 * f * h * w
    if end > frames.untyped_storage().nbytes():
        return None
    return frames.as_strided((f, 4, h, w), (4 * h * w, 1, 4 * w, 4))


def _patch_view(frames: torch.Tensor, temporal: int, patch: int, merge: int) -> torch.Tensor:
    """[F, C, H, W] -> [gt, gh/m, gw/m, m, m, C, T', P, P] view (no copy; T' = F // gt)."""
    f, c, h, w = frames.shape
    gh, gw = h // patch, w // patch
    # [F, C, H, W] -> [gt, T', C, gh/m, m, P, gw/m, m, P]
    v = frames.unflatten(0, (f // temporal, temporal))
    v = v.unflatten(3, (gh // merge, merge, patch)).unflatten(6, (gw // merge, merge, patch))
    # -> [gt, gh/m, gw/m, m, m, C, T', P, P]
    return v.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)


def norm_affine(
    mean: tuple[float, ...], std: tuple[float, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (scale, shift) with (x/255 - mean)/std == x*scale + shift."""
    std_t = torch.tensor(std, dtype=torch.float64)
    scale = 1.0 / (255.0 * std_t)
    shift = -torch.tensor(mean, dtype=torch.float64) / std_t
    return scale.float(), shift.float()


def patchify(
    frames: torch.Tensor,
    *,
    image: bool,
    patch: int,
    merge: int,
    temporal: int,
    layout: str,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    threads: int = 1,
) -> torch.Tensor:
    """Resized uint8 frames `[F, C, H, W]` -> feature rows.

    An image (F == 1): hf rows repeat the frame T times, compact-u8 rows hold it once.
    A video (F a multiple of `temporal`): T consecutive frames form one temporal patch.
    """
    f, c, h, w = frames.shape
    if h % (patch * merge) or w % (patch * merge):
        raise ValueError(f"frames of {h}x{w} are not multiples of {patch * merge}")
    if image and f != 1:
        raise ValueError(f"an image is one frame, got {f}")
    group = 1 if image else temporal
    if f % group:
        raise ValueError(f"{f} frames are not a multiple of the temporal patch size {temporal}")
    src = _patch_view(frames, group, patch, merge)
    gt, a, b = src.shape[0], src.shape[1], src.shape[2]
    rows = gt * a * b * merge * merge
    if layout not in ("hf", "compact-u8"):
        raise ValueError(f"unknown layout {layout!r}; use 'hf' or 'compact-u8'")
    if layout == "compact-u8":
        # One strided gather on uint8, straight into patch-row order.
        compact = empty_host((gt * a, b, merge, merge, c, group, patch, patch), torch.uint8)
        n_threads = threads_for(compact.nbytes, threads)
        geometry = dict(group=group, temporal=group, patch=patch, merge=merge)
        if patch_rows(frames, compact, **geometry, affine=None, threads=n_threads):
            return compact.view(rows, c * group * patch * patch)
        flat = src.flatten(0, 1)

        def gather(start: int, stop: int) -> None:
            compact[start:stop].copy_(flat[start:stop])

        run_split(gt * a, n_threads, gather)
        return compact.view(rows, c * group * patch * patch)
    out = _hf_rows(frames, group, temporal, patch, merge, mean, std, threads)
    return out.view(rows, c * temporal * patch * patch)


# Float elements normalised per step of the hf path: the step's float slab (x4 bytes) stays in
# the L2/L3 caches between the affine and the copy into the output.
_HF_STEP = 1 << 19


def _hf_rows(
    frames: torch.Tensor,
    group: int,
    temporal: int,
    patch: int,
    merge: int,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    threads: int,
) -> torch.Tensor:
    """Resized uint8 frames [F, C, H, W] -> normalised float32 rows [gt*a, b, m, m, C, T, P*P].

    NOTE: one write of the output: per step (a band of merge-block rows, `group` frames), apply
    the per-channel affine (mean and std folded with the 1/255 rescale) to the band as it lies
    in the frames, into a small float slab, then copy the slab into patch-row order with one
    strided copy (an image's T copies broadcast). The affine then runs over the N input pixels
    on contiguous memory, not over the T*N output values, and the output is written once.
    torch casts the uint8 band to float32 and runs its float32 addcmul kernel, so each value
    gets the same bits as normalising the float rows in patch order would give it.
    """
    f, c, h, w = frames.shape
    m, p = merge, patch
    band, a, b = m * p, h // (m * p), w // (m * p)
    gt = f // group
    out = empty_host((gt * a, b, m, m, c, temporal, p * p), torch.float32)
    n_threads = threads_for(out.nbytes, threads)
    affine = norm_affine(mean, std)
    geometry = dict(group=group, temporal=temporal, patch=p, merge=m)
    if patch_rows(frames, out, **geometry, affine=affine, threads=n_threads):
        return out
    step = max(1, min(b, _HF_STEP // (group * c * band * band)))  # merge blocks per step
    scale, shift = (t.view(1, c, 1, 1) for t in affine)

    def fill(start: int, stop: int) -> None:
        slab = torch.empty((group, c, band, step * band), dtype=torch.float32)
        for r in range(start, stop):
            t, i = divmod(r, a)
            rows = frames[t * group : (t + 1) * group, :, i * band : (i + 1) * band]
            for j in range(0, b, step):
                k = min(step, b - j)
                part = slab[..., : k * band]
                torch.addcmul(shift, rows[..., j * band : (j + k) * band], scale, out=part)
                # [T', C, m, P, k, m, P] -> [k, m, m, C, T', P, P], T' broadcast to T
                v = part.view(group, c, m, p, k, m, p).permute(4, 2, 5, 1, 0, 3, 6)
                dst = out[r, j : j + k].view(k, m, m, c, temporal, p, p)
                dst.copy_(v.expand(k, m, m, c, temporal, p, p))

    run_split(gt * a, n_threads, fill)
    return out
