"""Tiny Qwen-VL checkpoints that vLLM can serve: saved by transformers, with a tokenizer and
image/video processor configs, so vLLM's own pixel path and mmferry read the same folder.

vLLM's CPU attention needs a text head size of at least 32; Qwen3-VL gets two deepstack taps
and two decoder layers, so both deepstack additions land inside the model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

# The word-level tokenizer with Qwen's vision token ids lives with the prompt tests.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "prompt"))

from prompt_helpers import build_tokenizer_json  # noqa: E402

from mmferry.models import preset  # noqa: E402

PRESET = {"qwen2_5_vl": "qwen2.5-vl", "qwen3_vl": "qwen3-vl"}
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    vocab_size=152000,  # Qwen's vision token ids sit near the top
    max_position_embeddings=4096,
)
# Frames per test video and their rate; 4 frames are 2 temporal patches.
NUM_FRAMES, VIDEO_FPS = 4, 2.0
# Pixel budget of one image; sizes in the tests are multiples of the resize factor inside it,
# so no resampling happens and vLLM's processor and mmferry see the same pixels.
MAX_TOKENS_PER_IMAGE = 64
VISION_GAIN, LOGIT_GAIN = 8.0, 20.0


def _hf_model(family: str, wider: dict | None = None):
    import transformers

    if family == "qwen3_vl":
        vision = dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=TEXT["hidden_size"],
            patch_size=16,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0, 1],
        )
        rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [6, 5, 5]}
        rope["mrope_interleaved"] = True
        text = {**TEXT, "rope_parameters": rope}
        cfg = transformers.Qwen3VLConfig(vision_config=vision, text_config=text)
        return transformers.Qwen3VLForConditionalGeneration(cfg)
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=TEXT["hidden_size"],
        patch_size=14,
        window_size=56,
        fullatt_block_indexes=[1],
        tokens_per_second=2,
    )
    vision.update(wider or {})
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 6, 6]}
    text = {**TEXT, "rope_parameters": rope}
    cfg = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text)
    return transformers.Qwen2_5_VLForConditionalGeneration(cfg)


def _processor_configs(family: str, path: Path, max_tokens: int) -> None:
    cfg = preset(PRESET[family])
    f = cfg.factor
    common = dict(
        patch_size=cfg.patch_size,
        merge_size=cfg.merge_size,
        temporal_patch_size=cfg.temporal_patch_size,
        image_mean=list(cfg.image_mean),
        image_std=list(cfg.image_std),
        do_resize=True,
        do_rescale=True,
        do_normalize=True,
        do_convert_rgb=True,
    )
    image = dict(
        common,
        image_processor_type="Qwen2VLImageProcessor",
        size={"shortest_edge": f * f, "longest_edge": f * f * max_tokens},
    )
    video_cls = "Qwen3VLVideoProcessor" if family == "qwen3_vl" else "Qwen2VLVideoProcessor"
    video = dict(
        common,
        video_processor_type=video_cls,
        size={"shortest_edge": f * f * 4, "longest_edge": f * f * 4 * 12},
        do_sample_frames=False,
    )
    (path / "preprocessor_config.json").write_text(json.dumps(image, indent=1))
    (path / "video_preprocessor_config.json").write_text(json.dumps(video, indent=1))


def build_checkpoint(
    family: str, path: Path, vision: dict | None = None, max_tokens: int = MAX_TOKENS_PER_IMAGE
) -> Path:
    """Save a perturbed tiny `family` ("qwen2_5_vl" | "qwen3_vl") checkpoint into `path`;
    `vision` overrides Qwen2.5-VL's tower sizes (depth, width: the proxy benchmark's heavy
    tower), `max_tokens` is an image's token budget."""
    torch.manual_seed(0)
    model = _hf_model(family, vision)
    # Perturb every weight so norms, biases and the vision path are far from their init.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        # Louder vision rows and sharper logits: a random LM otherwise spreads its logits so
        # flat that the greedy tokens hardly depend on the image (the negative controls need
        # them to).
        visual = model.model.visual
        for merger in (visual.merger, *getattr(visual, "deepstack_merger_list", ())):
            last = getattr(merger, "linear_fc2", None) or merger.mlp[2]
            last.weight.mul_(VISION_GAIN)
            last.bias.mul_(VISION_GAIN)
        model.lm_head.weight.mul_(LOGIT_GAIN)
    model.eval().save_pretrained(path)
    build_tokenizer_json(path)
    _processor_configs(family, path, max_tokens)
    return path


def image(height: int, width: int, seed: int) -> np.ndarray:
    """A seeded random HWC uint8 image."""
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def gradient(height: int, width: int, seed: int) -> np.ndarray:
    """A smooth colour ramp: rows far from a noise image's, for the negative controls."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 1, width)[None, :, None] * rng.uniform(0, 255, (1, 1, 3))
    return np.broadcast_to(ramp, (height, width, 3)).astype(np.uint8).copy()


def video(height: int, width: int, seed: int = 7) -> np.ndarray:
    """A seeded THWC uint8 clip of NUM_FRAMES frames."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (NUM_FRAMES, height, width, 3), dtype=np.uint8)
