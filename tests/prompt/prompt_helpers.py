"""Helpers for the prompt tests: a tiny Qwen-style tokenizer, items, tiny transformers models."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from mmferry.config import TokenIds
from mmferry.items import MultimodalItem
from mmferry.models import preset

TOK = TokenIds()
SPECIALS = {
    "<|vision_start|>": TOK.vision_start,
    "<|vision_end|>": TOK.vision_end,
    "<|image_pad|>": TOK.image,
    "<|video_pad|>": TOK.video,
}
WORDS = ["hello", "world", "describe", "the", "video", "image", "and", "what", "happens", "?"]


def build_tokenizer_json(folder: Path) -> Path:
    """A word-level tokenizer with Qwen's vision token ids, saved as a checkpoint would be."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<": 1, ">": 2, ".": 3, "seconds": 4}
    vocab.update({str(d): 10 + d for d in range(10)})
    vocab.update({w: 100 + i for i, w in enumerate(WORDS)})
    vocab.update(SPECIALS)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    # "<12.5 seconds>" -> "<", "1", "2", ".", "5", "seconds", ">" (digits one by one, as Qwen's
    # BPE splits numbers).
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Punctuation(),
        ]
    )
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)
    path = folder / "tokenizer.json"
    assert path.is_file()
    return path


def make_item(
    modality: str,
    grid: tuple[int, int, int],
    *,
    timestamps: Sequence[float] | None = None,
    second_per_grid_t: float | None = None,
) -> MultimodalItem:
    """An item with zero features of the right shape: prompt code reads only its metadata."""
    t, h, w = grid
    return MultimodalItem(
        modality=modality,
        feature=torch.zeros(t * h * w, 8),
        grid_thw=grid,
        layout="hf",
        hash=f"{modality}-{t}x{h}x{w}",
        timestamps=None if timestamps is None else tuple(timestamps),
        second_per_grid_t=second_per_grid_t,
    )


def hf_processor(
    family: str, tokenizer, videos: list[tuple[tuple[int, int, int], list[int], float]]
):
    """The family's transformers processor; `videos` are (grid, frame indices, fps) per video."""
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_processing_utils import BaseVideoProcessor
    from transformers.video_utils import VideoMetadata

    base = {
        "qwen2_vl": Qwen2VLProcessor,
        "qwen2_5_vl": Qwen2_5_VLProcessor,
        "qwen3_vl": Qwen3VLProcessor,
    }[family]
    cfg = preset(family)

    class PrecomputedVideos(base):
        def check_argument_for_proper_class(self, name, arg):
            # The video-processor registry is a torchvision-less dummy here.
            if name == "video_processor":
                return type(arg)
            return super().check_argument_for_proper_class(name, arg)

        def _process_videos(self, pixel_videos, **kwargs):
            assert len(pixel_videos) == len(videos)
            processed = {
                "video_grid_thw": torch.tensor([g for g, _, _ in videos]),
                "video_metadata": [
                    VideoMetadata(total_num_frames=max(ix) + 1, fps=fps, frames_indices=list(ix))
                    for _, ix, fps in videos
                ],
            }
            repl = [self.replace_video_token(processed, video_idx=i) for i in range(len(videos))]
            return processed, repl

    image_processor = Qwen2VLImageProcessorPil(
        patch_size=cfg.patch_size,
        merge_size=cfg.merge_size,
        temporal_patch_size=cfg.temporal_patch_size,
        min_pixels=cfg.factor**2,
        max_pixels=cfg.factor**2 * 64,
    )
    video_processor = BaseVideoProcessor(
        merge_size=cfg.merge_size, temporal_patch_size=cfg.temporal_patch_size
    )
    return PrecomputedVideos(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor
    )


def hf_timestamps(indices: list[int], fps: float, merge: int = 2) -> list[float]:
    """Seconds per temporal patch: pad indices to a multiple of `merge`, mean of first and last."""
    ix = list(indices) + [indices[-1]] * (-len(indices) % merge)
    return [(ix[i] / fps + ix[i + merge - 1] / fps) / 2 for i in range(0, len(ix), merge)]
