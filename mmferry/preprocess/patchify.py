"""Resized uint8 frames -> patch rows in merge-block order, in the hf or compact-u8 layout.

Row order (both layouts, images and videos) is transformers' Qwen-VL order: temporal patch,
then merge block (row-major), then the m x m patches inside the block. Row contents are
`[C][T][P][P]` (hf, and compact-u8 videos) or `[C][P][P]` (compact-u8 images).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmferry.preprocess.buffers import empty_host
from mmferry.preprocess.threads import run_split, threads_for


def resize_u8(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[F, C, H, W] uint8 -> [F, C, height, width] uint8, antialiased bicubic.

    torch's native uint8 antialiased bicubic kernel is the one torchvision (and so transformers'
    default Qwen-VL processors) runs on CPU for uint8 input; an unchanged size is returned as is.
    Input in channels-last memory (HWC frames) takes torch's fast vectorised uint8 kernel;
    other strides are made channels-last first (one copy, cheaper than the planar kernel).
    The output is the same bit for bit either way.
    """
    if tuple(frames.shape[-2:]) == (height, width):
        return frames
    frames = frames.contiguous(memory_format=torch.channels_last)
    return F.interpolate(
        frames, size=(height, width), mode="bicubic", antialias=True, align_corners=False
    )


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
        flat = src.flatten(0, 1)

        def gather(start: int, stop: int) -> None:
            compact[start:stop].copy_(flat[start:stop])

        run_split(gt * a, threads_for(compact.nbytes, threads), gather)
        return compact.view(rows, c * group * patch * patch)
    out = _hf_rows(src, temporal, mean, std, threads)
    return out.view(rows, c * temporal * patch * patch)


# uint8 elements gathered per step of the hf path: the step's float output (x4 bytes, x T)
# stays in the L2/L3 caches between the widening copy and the in-place affine.
_HF_STEP = 1 << 18


def _hf_rows(
    src: torch.Tensor,
    temporal: int,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    threads: int,
) -> torch.Tensor:
    """Patch view [gt, a, b, m, m, C, T', P, P] uint8 -> normalised float32 rows, T copies.

    NOTE: one write of the output: per step of merge blocks, gather uint8 into a small buffer,
    widen it (broadcasting an image's T copies) into the output, and apply the per-channel
    affine (mean and std folded with the 1/255 rescale) in place while the step is in cache.
    torch's mixed-dtype strided kernels are several times slower than these passes together.
    """
    gt, a, b, m, _, c, group, p, _ = src.shape
    out = empty_host((gt * a, b, m, m, c, temporal, p * p), torch.float32)
    src = src.flatten(0, 1)  # [gt*a, b, m, m, C, T', P, P]
    per_block = m * m * c * group * p * p
    step = max(1, min(b, _HF_STEP // per_block))  # merge blocks per step
    scale, shift = norm_affine(mean, std)
    scale, shift = scale.view(1, 1, 1, c, 1, 1), shift.view(1, 1, 1, c, 1, 1)

    def fill(start: int, stop: int) -> None:
        tmp = torch.empty((step, m, m, c, group, p, p), dtype=torch.uint8)
        for i in range(start, stop):
            for j in range(0, b, step):
                k = min(step, b - j)
                part, dst = tmp[:k], out[i, j : j + k]
                part.copy_(src[i, j : j + k])
                dst.copy_(part.view(k, m, m, c, group, p * p).expand(k, m, m, c, temporal, p * p))
                torch.addcmul(shift, dst, scale, out=dst)

    run_split(src.shape[0], threads_for(out.nbytes, threads), fill)
    return out
