"""Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE: their specs and their shared vision tower.

Tower attribute names mirror the checkpoints, so `model.visual.<key>` maps to `<key>` one-to-one:
patch_embed.proj, pos_embed, blocks.N.{norm1,norm2,attn.qkv,attn.proj,mlp.linear_fc1,
mlp.linear_fc2}, merger.{norm,linear_fc1,linear_fc2}, deepstack_merger_list.N.{...}.
Video: frames spread evenly over the clip, a pixel budget per frame, and one `<t seconds>`
text per temporal patch in the prompt. Qwen3.5 has its own token ids and no deepstack taps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mmferry.config import ProcessorConfig, TokenIds, VisionConfig
from mmferry.encoder.attention import AttentionFn
from mmferry.encoder.layers import InputKind, PatchEmbed, VisionBlock, layer_norm, rope_tables
from mmferry.encoder.metadata import TowerMetadata, build_metadata
from mmferry.models.base import ModelSpec
from mmferry.preprocess.sampling import even_indices, per_frame_size

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


class Qwen3PatchMerger(nn.Module):
    """2x2 merge-block shuffle + MLP; deepstack mergers normalise after the shuffle."""

    def __init__(self, cfg: VisionConfig, postshuffle_norm: bool) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = layer_norm(self.width if postshuffle_norm else cfg.hidden_size)
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
        self.blocks = nn.ModuleList(
            VisionBlock(cfg, layer_norm, Qwen3VisionMLP(cfg)) for _ in range(cfg.depth)
        )
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
        segments: Sequence[tuple[InputKind, torch.Tensor]],
        meta: TowerMetadata,
        attend: AttentionFn,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Feature rows (per input kind, packed in `meta.grids` order) -> merged [N/4, out] and
        one [N/4, out] tensor per deepstack tap."""
        return self.body(self.patch_embed(segments), meta, attend)

    def body(
        self, x: torch.Tensor, meta: TowerMetadata, attend: AttentionFn
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Patch embeddings [N, hidden] -> merged rows and deepstack rows: everything after the
        patch embedding, with static shapes for a given N (what a CUDA graph captures)."""
        pos = F.embedding_bag(
            meta.interp_taps,
            self.pos_embed.weight,
            per_sample_weights=meta.interp_weights.to(x.dtype),
            mode="sum",
        )
        x.add_(pos)  # x is the tower's own: fresh embeddings, or a graph input refilled per call
        rope = rope_tables(meta.positions, meta.inv_freq)
        taps = {layer: i for i, layer in enumerate(self.cfg.deepstack_visual_indexes)}
        deepstack: list[torch.Tensor] = []
        for layer, block in enumerate(self.blocks):
            x = block(x, rope, meta.full, attend)
            if layer in taps:
                deepstack.append(self.deepstack_merger_list[taps[layer]](x))
        return self.merger(x), deepstack


QWEN3_VL_FIELDS = {
    "depth": (("depth",), 27),
    "hidden_size": (("hidden_size",), 1152),
    "intermediate_size": (("intermediate_size",), 4304),
    "num_heads": (("num_heads",), 16),
    "out_hidden_size": (("out_hidden_size",), 3584),
    "hidden_act": (("hidden_act",), "gelu_pytorch_tanh"),
    "patch_size": (("patch_size",), 16),
    "spatial_merge_size": (("spatial_merge_size",), 2),
    "temporal_patch_size": (("temporal_patch_size",), 2),
    "in_channels": (("in_channels",), 3),
    "num_position_embeddings": (("num_position_embeddings",), 2304),
    "deepstack_visual_indexes": (("deepstack_visual_indexes",), (8, 16, 24)),
}
# Qwen3.5 towers have no deepstack taps.
QWEN3_5_FIELDS = {
    **QWEN3_VL_FIELDS,
    "deepstack_visual_indexes": (("deepstack_visual_indexes",), ()),
}

HALF = (0.5, 0.5, 0.5)
QWEN3_5_TOKENS = TokenIds(image=248056, video=248057, vision_start=248053, vision_end=248054)

QWEN3_VL = ModelSpec(
    model_type="qwen3_vl",
    family="qwen3_vl",
    preset_name="qwen3-vl",
    hf_vision=QWEN3_VL_FIELDS,
    tokens=TokenIds(),
    processor=ProcessorConfig(
        family="qwen3_vl",
        patch_size=16,
        image_min_pixels=65536,
        image_max_pixels=16777216,
        image_mean=HALF,
        image_std=HALF,
        video_min_pixels=4096,
        video_max_pixels=25165824,
        video_mean=HALF,
        video_std=HALF,
    ),
    # Qwen3VLVideoProcessor's defaults.
    hf_video_defaults={
        "video_min_pixels": 128 * 32 * 32,
        "video_max_pixels": 768 * 32 * 32,
        "video_mean": HALF,
        "video_std": HALF,
        "do_sample_frames": True,
        "fps": 2.0,
        "num_frames": None,
        "min_frames": 4,
        "max_frames": 768,
        "cap_pixels_per_frame": False,
    },
    # Qwen3-VL-2B/4B's tower.
    random_config=VisionConfig(
        family="qwen3_vl",
        depth=24,
        hidden_size=1024,
        intermediate_size=4096,
        num_heads=16,
        out_hidden_size=2048,
        hidden_act="gelu_pytorch_tanh",
        patch_size=16,
        num_position_embeddings=2304,
        deepstack_visual_indexes=(5, 11, 17),
    ),
    tiny_config=VisionConfig(
        family="qwen3_vl",
        depth=3,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        out_hidden_size=48,
        hidden_act="gelu_pytorch_tanh",
        patch_size=16,
        num_position_embeddings=144,
        deepstack_visual_indexes=(0, 2),
    ),
    tower=Qwen3VisionTower,
    sample_frames=even_indices,
    frame_size=per_frame_size,
    timestamps_in_prompt=True,
)

_QWEN3_5 = dataclasses.replace(
    QWEN3_VL,
    model_type="qwen3_5",
    preset_name="qwen3.5",
    hf_vision=QWEN3_5_FIELDS,
    tokens=QWEN3_5_TOKENS,
    processor=QWEN3_VL.processor.replace(tokens=QWEN3_5_TOKENS),
    random_config=dataclasses.replace(QWEN3_VL.random_config, deepstack_visual_indexes=()),
    tiny_config=dataclasses.replace(QWEN3_VL.tiny_config, deepstack_visual_indexes=()),
)

# The registry's entries (`mmferry/models/registry.py`).
SPECS = (
    QWEN3_VL,
    dataclasses.replace(QWEN3_VL, model_type="qwen3_vl_moe", preset_name="qwen3-vl-moe"),
    _QWEN3_5,
    dataclasses.replace(_QWEN3_5, model_type="qwen3_5_moe", preset_name="qwen3.5-moe"),
)
