"""Qwen2.5-VL and Qwen2-VL vision towers.

Attribute names mirror the checkpoints (`visual.<key>` or `model.visual.<key>` -> `<key>`):
patch_embed.proj, blocks.N.{norm1,norm2,attn.qkv,attn.proj,mlp.*}, merger.{ln_q,mlp.0,mlp.2}.
Qwen2.5-VL: RMSNorm, SwiGLU MLP (gate_proj/up_proj/down_proj), window attention except in
`fullatt_block_indexes`. Qwen2-VL: LayerNorm, quick-GELU MLP (fc1/fc2), full attention only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mmferry.config import VisionConfig
from mmferry.encoder.attention import AttentionFn
from mmferry.encoder.layers import PatchEmbed, VisionAttention, rope_tables
from mmferry.encoder.metadata import TowerMetadata, build_metadata


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


class SwiGLU(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=True)
        self.up_proj = nn.Linear(h, i, bias=True)
        self.down_proj = nn.Linear(i, h, bias=True)
        if cfg.hidden_act != "silu":
            raise ValueError(f"unsupported Qwen2.5-VL vision activation {cfg.hidden_act!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


class QuickGeluMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        acts = {"quick_gelu": _quick_gelu, "gelu": F.gelu, "silu": F.silu}
        if cfg.hidden_act not in acts:
            raise ValueError(f"unsupported Qwen2-VL vision activation {cfg.hidden_act!r}")
        self.act = acts[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Qwen2VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        qwen2_5 = cfg.family == "qwen2_5_vl"
        norm = RMSNorm if qwen2_5 else (lambda d: nn.LayerNorm(d, eps=1e-6))
        self.norm1 = norm(cfg.hidden_size)
        self.norm2 = norm(cfg.hidden_size)
        self.attn = VisionAttention(cfg)
        self.mlp = SwiGLU(cfg) if qwen2_5 else QuickGeluMLP(cfg)

    def forward(self, x, rope, batch, attend) -> torch.Tensor:
        # NOTE: residual adds are in place; the tower owns x (inference only).
        x.add_(self.attn(self.norm1(x), rope, batch, attend))
        return x.add_(self.mlp(self.norm2(x)))


class Qwen2PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        if cfg.family == "qwen2_5_vl":
            self.ln_q = RMSNorm(cfg.hidden_size)
        else:
            self.ln_q = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, cfg.out_hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))  # [N, hidden] -> [N/4, 4*hidden]


class Qwen2VisionTower(nn.Module):
    """Qwen2-VL / Qwen2.5-VL tower: patch embed, 2-D rope blocks, merger (no deepstack)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, bias=False)
        self.blocks = nn.ModuleList(Qwen2VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = Qwen2PatchMerger(cfg)
        self.windowed = cfg.family == "qwen2_5_vl"
        if self.windowed and cfg.window_size < cfg.spatial_merge_size * cfg.patch_size:
            raise ValueError(f"window_size {cfg.window_size} is smaller than one merge block")

    def metadata(self, grids: Sequence[tuple[int, int, int]]) -> TowerMetadata:
        """Host metadata for patches packed in `grids` order."""
        cfg = self.cfg
        window = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
        return build_metadata(
            grids,
            merge=cfg.spatial_merge_size,
            head_dim=cfg.head_dim,
            window=window if self.windowed else 0,
        )

    def forward(
        self,
        segments: Sequence[tuple[str, torch.Tensor]],
        meta: TowerMetadata,
        attend: AttentionFn,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Patch rows (per input kind, packed in `meta.grids` order) -> merged [N/4, out]."""
        x = self.patch_embed(segments)
        unit = self.cfg.spatial_merge_size**2
        if self.windowed:
            # Into window order, one merge block (unit rows) at a time: [N, D] -> [N/unit, unit*D]
            x = x.view(-1, unit * x.shape[1]).index_select(0, meta.window_index).view(x.shape)
        rope = rope_tables(meta.positions, meta.inv_freq)
        full = (
            set(self.cfg.fullatt_block_indexes) if self.windowed else set(range(len(self.blocks)))
        )
        for layer, block in enumerate(self.blocks):
            batch = meta.full if layer in full else meta.windows
            x = block(x, rope, batch, attend)
        out = self.merger(x)
        if self.windowed:
            out = out.index_select(0, meta.window_reverse)
        return out, []
