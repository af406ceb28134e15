"""Qwen3-VL vision tower (also Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE, which share it).

Attribute names mirror the checkpoints, so `model.visual.<key>` maps to `<key>` here one-to-one:
patch_embed.proj, pos_embed, blocks.N.{norm1,norm2,attn.qkv,attn.proj,mlp.linear_fc1,
mlp.linear_fc2}, merger.{norm,linear_fc1,linear_fc2}, deepstack_merger_list.N.{...}.
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

# In-place activations: the MLP's [N, intermediate] tensor is the largest of a layer, and not
# allocating a second one saves a pass of fresh memory per block.
_ACTS = {
    "gelu_pytorch_tanh": lambda x: torch.ops.aten.gelu_(x, approximate="tanh"),
    "gelu": lambda x: torch.ops.aten.gelu_(x),
    "silu": lambda x: F.silu(x, inplace=True),
}


class Qwen3VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        if cfg.hidden_act not in _ACTS:
            raise ValueError(f"unsupported Qwen3-VL vision activation {cfg.hidden_act!r}")
        self.act = _ACTS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = Qwen3VisionMLP(cfg)

    def forward(self, x, rope, batch, attend) -> torch.Tensor:
        # NOTE: residual adds are in place; the tower owns x (inference only).
        x.add_(self.attn(self.norm1(x), rope, batch, attend))
        return x.add_(self.mlp(self.norm2(x)))


class Qwen3PatchMerger(nn.Module):
    """2x2 merge-block shuffle + MLP; deepstack mergers normalise after the shuffle."""

    def __init__(self, cfg: VisionConfig, postshuffle_norm: bool) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.width if postshuffle_norm else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            x = self.norm(x.view(-1, self.width))  # [N, hidden] -> [N/4, 4*hidden]
        else:
            x = self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTower(nn.Module):
    """Patch embed + interpolated learned positions + 2-D rope blocks + (deepstack) mergers."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.side = int(cfg.num_position_embeddings**0.5)
        if self.side * self.side != cfg.num_position_embeddings:
            raise ValueError(
                f"num_position_embeddings {cfg.num_position_embeddings} is not a square"
            )
        self.blocks = nn.ModuleList(Qwen3VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = Qwen3PatchMerger(cfg, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(cfg, postshuffle_norm=True) for _ in cfg.deepstack_visual_indexes
        )

    def metadata(self, grids: Sequence[tuple[int, int, int]]) -> TowerMetadata:
        """Host metadata for patches packed in `grids` order."""
        return build_metadata(
            grids,
            merge=self.cfg.spatial_merge_size,
            head_dim=self.cfg.head_dim,
            position_side=self.side,
        )

    def forward(
        self,
        segments: Sequence[tuple[str, torch.Tensor]],
        meta: TowerMetadata,
        attend: AttentionFn,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Patch rows (per input kind, packed in `meta.grids` order) -> merged [N/4, out] and
        one [N/4, out] tensor per deepstack tap."""
        x = self.patch_embed(segments)
        pos = F.embedding_bag(
            meta.interp_taps,
            self.pos_embed.weight,
            per_sample_weights=meta.interp_weights.to(x.dtype),
            mode="sum",
        )
        x.add_(pos)  # x is the fresh patch-embedding output
        rope = rope_tables(meta.positions, meta.inv_freq)
        taps = {layer: i for i, layer in enumerate(self.cfg.deepstack_visual_indexes)}
        deepstack: list[torch.Tensor] = []
        for layer, block in enumerate(self.blocks):
            x = block(x, rope, meta.full, attend)
            if layer in taps:
                deepstack.append(self.deepstack_merger_list[taps[layer]](x))
        return self.merger(x), deepstack
