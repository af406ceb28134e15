"""Qwen2-VL and Qwen2.5-VL: their specs and their vision tower.

Tower attribute names mirror the checkpoints (`visual.<key>` or `model.visual.<key>` -> `<key>`):
patch_embed.proj, blocks.N.{norm1,norm2,attn.qkv,attn.proj,mlp.*}, merger.{ln_q,mlp.0,mlp.2}.
Qwen2.5-VL: RMSNorm, SwiGLU MLP (gate_proj/up_proj/down_proj), window attention except in
`fullatt_block_indexes`. Qwen2-VL: LayerNorm, quick-GELU MLP (fc1/fc2), full attention only.
Video: frames sampled at a fixed stride in whole temporal patches, one pixel budget for the
clip; seconds scale the mRoPE time axis (Qwen2.5-VL) and the prompt carries no timestamps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from mmferry.config import CLIP_MEAN, CLIP_STD, ProcessorConfig, TokenIds, VisionConfig
from mmferry.encoder.attention import AttentionFn
from mmferry.encoder.layers import (
    InputKind,
    PatchEmbed,
    RMSNorm,
    VisionBlock,
    layer_norm,
    rope_tables,
)
from mmferry.encoder.metadata import TowerMetadata, build_metadata
from mmferry.models.base import ModelSpec
from mmferry.preprocess.sampling import stride_indices, whole_clip_size


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


class Qwen2PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = norm(cfg.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, cfg.out_hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))  # [N, hidden] -> [N/4, 4*hidden]


class Qwen2VisionTower(nn.Module):
    """Qwen2-VL / Qwen2.5-VL tower: patch embed, 2-D rope blocks, merger (no deepstack).

    `windowed` (Qwen2.5-VL) picks RMSNorm, the SwiGLU MLP and window attention; otherwise
    LayerNorm, the quick-GELU MLP and full attention (Qwen2-VL).
    """

    def __init__(self, cfg: VisionConfig, *, windowed: bool) -> None:
        super().__init__()
        self.cfg = cfg
        norm = RMSNorm if windowed else layer_norm
        mlp = SwiGLU if windowed else QuickGeluMLP
        self.patch_embed = PatchEmbed(cfg, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(cfg, norm, mlp(cfg)) for _ in range(cfg.depth))
        self.merger = Qwen2PatchMerger(cfg, norm)
        self.windowed = windowed
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
        segments: Sequence[tuple[InputKind, torch.Tensor]],
        meta: TowerMetadata,
        attend: AttentionFn,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Feature rows (per input kind, packed in `meta.grids` order) -> merged [N/4, out]."""
        return self.body(self.patch_embed(segments), meta, attend)

    def body(
        self, x: torch.Tensor, meta: TowerMetadata, attend: AttentionFn
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Patch embeddings [N, hidden] -> merged [N/4, out]: everything after the patch
        embedding, with static shapes for a given N (what a CUDA graph captures)."""
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


# HF spellings of the shared fields; Qwen2-VL names the tower width `embed_dim`, the LLM width
# `hidden_size`, and gives the MLP width as a ratio.
_COMMON = {
    "depth": (("depth",), 32),
    "num_heads": (("num_heads",), 16),
    "patch_size": (("patch_size",), 14),
    "spatial_merge_size": (("spatial_merge_size",), 2),
    "temporal_patch_size": (("temporal_patch_size",), 2),
    "in_channels": (("in_channels", "in_chans"), 3),
}
QWEN2_VL_FIELDS = {
    **_COMMON,
    "hidden_size": (("embed_dim",), 1280),
    "intermediate_size": lambda v: int(v.get("embed_dim", 1280) * v.get("mlp_ratio", 4)),
    "out_hidden_size": (("hidden_size",), 3584),
    "hidden_act": (("hidden_act",), "quick_gelu"),
}
QWEN2_5_VL_FIELDS = {
    **_COMMON,
    "hidden_size": (("hidden_size",), 3584),
    "intermediate_size": (("intermediate_size",), 3420),
    "out_hidden_size": (("out_hidden_size",), 3584),
    "hidden_act": (("hidden_act",), "silu"),
    "window_size": (("window_size",), 112),
    "fullatt_block_indexes": (("fullatt_block_indexes",), (7, 15, 23, 31)),
    "tokens_per_second": (("tokens_per_second",), 4),
}

_PROCESSOR = ProcessorConfig(family="qwen2_vl", patch_size=14)
# Qwen2VLVideoProcessor's defaults (both families use it): every frame unless asked to sample.
_HF_VIDEO = {
    "video_min_pixels": 128 * 28 * 28,
    "video_max_pixels": 768 * 28 * 28,
    "video_mean": CLIP_MEAN,
    "video_std": CLIP_STD,
    "do_sample_frames": False,
    "fps": None,
    "num_frames": None,
    "min_frames": 4,
    "max_frames": 768,
    "cap_pixels_per_frame": False,
}

QWEN2_VL = ModelSpec(
    model_type="qwen2_vl",
    family="qwen2_vl",
    preset_name="qwen2-vl",
    hf_vision=QWEN2_VL_FIELDS,
    tokens=TokenIds(),
    processor=_PROCESSOR,
    hf_video_defaults=_HF_VIDEO,
    # Qwen2-VL-2B's tower.
    random_config=VisionConfig(
        family="qwen2_vl",
        depth=32,
        hidden_size=1280,
        intermediate_size=5120,
        num_heads=16,
        out_hidden_size=1536,
        hidden_act="quick_gelu",
        patch_size=14,
    ),
    tiny_config=VisionConfig(
        family="qwen2_vl",
        depth=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        out_hidden_size=48,
        hidden_act="quick_gelu",
        patch_size=14,
    ),
    tower=partial(Qwen2VisionTower, windowed=False),
    sample_frames=stride_indices,
    frame_size=whole_clip_size,
    video_takes_pixel_options=True,
)

QWEN2_5_VL = ModelSpec(
    model_type="qwen2_5_vl",
    family="qwen2_5_vl",
    preset_name="qwen2.5-vl",
    hf_vision=QWEN2_5_VL_FIELDS,
    tokens=TokenIds(),
    processor=_PROCESSOR.replace(family="qwen2_5_vl"),
    hf_video_defaults=_HF_VIDEO,
    # Qwen2.5-VL-7B's tower.
    random_config=VisionConfig(
        family="qwen2_5_vl",
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=3584,
        hidden_act="silu",
        patch_size=14,
        window_size=112,
        fullatt_block_indexes=(7, 15, 23, 31),
        tokens_per_second=2,
    ),
    tiny_config=VisionConfig(
        family="qwen2_5_vl",
        depth=3,
        hidden_size=64,
        intermediate_size=96,
        num_heads=4,
        out_hidden_size=48,
        hidden_act="silu",
        patch_size=14,
        window_size=56,
        fullatt_block_indexes=(1,),
        tokens_per_second=2,
    ),
    tower=partial(Qwen2VisionTower, windowed=True),
    mlp_matmuls=3,
    windowed=True,
    sample_frames=stride_indices,
    frame_size=whole_clip_size,
    video_takes_pixel_options=True,
    video_time_in_mrope=True,
)

# The registry's entries (`mmferry/models/registry.py`).
SPECS = (QWEN2_VL, QWEN2_5_VL)
