"""Resized uint8 frames -> patch rows in merge-block order, in the hf or compact-u8 layout.

Row order (both layouts, images and videos) is transformers' Qwen-VL order: temporal patch,
then merge block (row-major), then the m x m patches inside the block. Row contents are
`[C][T][P][P]` (hf, and compact-u8 videos) or `[C][P][P]` (compact-u8 images).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmferry.preprocess.buffers import empty_host


def resize_u8(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[F, C, H, W] uint8 -> [F, C, height, width] uint8, antialiased bicubic.

    torch's native uint8 antialiased bicubic kernel is the one torchvision (and so transformers'
    default Qwen-VL processors) runs on CPU for uint8 input; an unchanged size is returned as is.
    """
    if tuple(frames.shape[-2:]) == (height, width):
        return frames
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
    # The strided gather runs on uint8 (4x fewer bytes than float), into patch-row order.
    compact = empty_host((gt, a, b, merge, merge, c, group, patch, patch), torch.uint8)
    compact.copy_(src)
    if layout == "compact-u8":
        return compact.view(rows, c * group * patch * patch)
    # NOTE: hf = one contiguous widening copy that also broadcasts an image's T copies, then the
    # per-channel affine (mean and std folded with the 1/255 rescale) once, in place, where it
    # vectorises. torch's mixed-dtype strided kernels are slower than these passes together.
    out = empty_host((rows, c, temporal, patch * patch), torch.float32)
    out.copy_(compact.view(rows, c, group, patch * patch).expand(rows, c, temporal, patch * patch))
    scale, shift = norm_affine(mean, std)
    per_c = out.view(rows, c, temporal * patch * patch)
    torch.addcmul(shift.view(1, c, 1), per_c, scale.view(1, c, 1), out=per_c)
    return out.view(rows, c * temporal * patch * patch)
