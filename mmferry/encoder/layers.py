"""Pieces shared by the vision towers: patch embedding (with the compact-u8 fold) and 2-D rope.

Compact-u8 fold. HF-layout rows are x[c,t,p,q] = (u[c,p,q]/255 - mu_c)/sigma_c, with an image's
T temporal copies identical. The patch embedding is y = sum_{c,t,p,q} W[o,c,t,p,q] x[c,t,p,q] + b,
so with W'[o,c,p,q] = sum_t W[o,c,t,p,q] / (255 sigma_c):

    y = sum_{c,p,q} W'[o,c,p,q] u[c,p,q] + (b - sum_{c,p,q} W'[o,c,p,q] 255 mu_c) = W' u + b'

which is exact: the normalised float tensor and the T copy never exist. Videos carry all T
frames, so their fold is per channel only: W'[o,c,t,p,q] = W[o,c,t,p,q] / (255 sigma_c).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mmferry.config import VisionConfig

# Patch-embedding inputs, as (layout, modality): HF float rows (either modality), compact-u8
# image rows (no T copy) and compact-u8 video rows. One batch packs them in this order.
INPUT_KINDS: tuple[tuple[str, str | None], ...] = (
    ("hf", None),
    ("compact-u8", "image"),
    ("compact-u8", "video"),
)
InputKind = tuple[str, "str | None"]


class PatchEmbed(nn.Module):
    """Conv3d with kernel == stride, run as one matmul over flattened patches.

    `proj` keeps the checkpoint's Conv3d name and weight shape [hidden, C, T, P, P] so keys load
    one-to-one; the convolution itself is never called.
    """

    def __init__(self, cfg: VisionConfig, bias: bool) -> None:
        super().__init__()
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, k, stride=k, bias=bias)
        self.in_channels = cfg.in_channels
        # Compact-u8 weights and biases by modality (see `fold_compact`).
        self.folded: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def fold_compact(
        self,
        image_mean: Sequence[float],
        image_std: Sequence[float],
        video_mean: Sequence[float],
        video_std: Sequence[float],
    ) -> None:
        """Precompute the compact-u8 weights for images and videos (see the module docstring)."""
        w = self.proj.weight
        # Fold in float64 on the weight's device: exact enough that bf16/fp32 casts dominate.
        w64 = w.detach().to(torch.float64)
        b64 = (
            self.proj.bias.detach().to(torch.float64)
            if self.proj.bias is not None
            else torch.zeros(w.shape[0], dtype=torch.float64, device=w.device)
        )
        for modality, mean, std, w_kind in (
            ("image", image_mean, image_std, w64.sum(dim=2)),  # [o, C, P, P]
            ("video", video_mean, video_std, w64),  # [o, C, T, P, P]
        ):
            shape = (1, -1) + (1,) * (w_kind.dim() - 2)
            sigma = torch.tensor(std, dtype=torch.float64, device=w.device).view(shape)
            mu = torch.tensor(mean, dtype=torch.float64, device=w.device).view(shape)
            w_fold = w_kind / (255.0 * sigma)
            b_fold = b64 - (w_fold * (255.0 * mu)).flatten(1).sum(1)
            self.folded[modality] = (w_fold.flatten(1).to(w.dtype), b_fold.to(w.dtype))

    def _weights(self, kind: InputKind) -> tuple[torch.Tensor, torch.Tensor | None]:
        layout, modality = kind
        if layout == "hf":
            return self.proj.weight.flatten(1), self.proj.bias
        if modality not in self.folded:
            raise ValueError(f"compact-u8 {modality} input needs fold_compact() first")
        return self.folded[modality]

    def forward(self, segments: Sequence[tuple[InputKind, torch.Tensor]]) -> torch.Tensor:
        """Row blocks of each input kind, in order -> one [rows, hidden] tensor.

        hf and compact-u8 video rows are [n, C*T*P*P], compact-u8 image rows [n, C*P*P].
        """
        dtype = self.proj.weight.dtype
        if len(segments) == 1:
            kind, x = segments[0]
            return F.linear(x.to(dtype), *self._weights(kind))
        rows = sum(x.shape[0] for _, x in segments)
        out = torch.empty((rows, self.proj.out_channels), dtype=dtype, device=segments[0][1].device)
        start = 0
        for kind, x in segments:
            weight, bias = self._weights(kind)
            dst = out[start : start + x.shape[0]]
            # Each kind's rows land in their slice of one buffer: no concatenation afterwards.
            if bias is None:
                torch.mm(x.to(dtype), weight.t(), out=dst)
            else:
                torch.addmm(bias, x.to(dtype), weight.t(), out=dst)
            start += x.shape[0]
        return out


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, head_dim/2] (float32) for (row, col) positions [N, 2]."""
    # [N, 2, 1] * [F] -> [N, 2, F] -> [N, 2F]: row frequencies first, then column ones.
    angles = (positions[:, :, None].to(torch.float32) * inv_freq).flatten(1)
    return angles.cos(), angles.sin()


def apply_rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope on q and k together: qk [N, 2, H, D] -> new [N, 2, H, D].

    cos/sin hold the first half of the (duplicated) angle table, so the rotation is
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), computed in float32.
    """
    half = qk.shape[-1] // 2
    c = cos[:, None, None, :]
    s = sin[:, None, None, :]
    src = qk if qk.dtype == torch.float32 else qk.float()
    x1, x2 = src[..., :half], src[..., half:]
    out = torch.empty(src.shape, dtype=torch.float32, device=src.device)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, c, out=o1)
    o1.addcmul_(x2, s, value=-1)
    torch.mul(x2, c, out=o2)
    o2.addcmul_(x1, s)
    return out if qk.dtype == torch.float32 else out.to(qk.dtype)


class VisionAttention(nn.Module):
    """Fused-qkv self-attention over packed sequences with 2-D rope."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x, rope, batch, attend) -> torch.Tensor:
        n = x.shape[0]
        # [N, 3*hidden] -> [N, 3, H, D]
        qkv = self.qkv(x).view(n, 3, self.num_heads, -1)
        qk = apply_rope(qkv[:, :2], *rope)
        return self.proj(attend(qk[:, 0], qk[:, 1], qkv[:, 2], batch))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32 whatever the model dtype, as the checkpoints were trained.
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def layer_norm(dim: int) -> nn.Module:
    """The towers' LayerNorm (eps 1e-6, as every Qwen-VL vision config sets)."""
    return nn.LayerNorm(dim, eps=1e-6)


class VisionBlock(nn.Module):
    """Pre-norm transformer block of every Qwen-VL tower: norm1, attn, norm2, mlp."""

    def __init__(self, cfg: VisionConfig, norm: Callable[[int], nn.Module], mlp: nn.Module) -> None:
        super().__init__()
        self.norm1 = norm(cfg.hidden_size)
        self.norm2 = norm(cfg.hidden_size)
        self.attn = VisionAttention(cfg)
        self.mlp = mlp

    def forward(self, x, rope, batch, attend) -> torch.Tensor:
        # NOTE: residual adds are in place; the tower owns x (inference only).
        x.add_(self.attn(self.norm1(x), rope, batch, attend))
        return x.add_(self.mlp(self.norm2(x)))
