"""The references for chat messages: transformers' processors and qwen-vl-utils, run here.

Neither runs as installed: transformers' Qwen-VL image and video processors and qwen-vl-utils
call torchvision, which does not import beside this torch. Only torchvision's CPU kernels are
restated (the antialiased bicubic resize on uint8, normalisation), exactly as
tests/preprocess/reference.py restates them; transformers' and qwen-vl-utils' own code does all
the rest (templates, sampling, sizing, patchify, metadata, timestamps, token expansion). Video
files are read by transformers' PyAV reader, and by qwen-vl-utils through a `decord` stand-in
over PyAV (its frame range and sampling code then run as they do with decord).
"""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import av
import numpy as np
import torch
import torch.nn.functional as F

from tests.preprocess.reference import import_without_torchvision

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", *VISION_TOKENS)


class _Interpolation:
    NEAREST, NEAREST_EXACT, BILINEAR, BICUBIC = "nearest", "nearest-exact", "bilinear", "bicubic"
    BOX, HAMMING, LANCZOS = "box", "hamming", "lanczos"


def _resize(x: torch.Tensor, size, interpolation=None, antialias=True) -> torch.Tensor:
    # torchvision's CPU bicubic (uint8 or float): torch's antialiased kernel, any leading dims.
    assert interpolation in (None, _Interpolation.BICUBIC), interpolation
    lead = x.shape[:-3]
    y = F.interpolate(x.reshape(-1, *x.shape[-3:]), size=list(size), mode="bicubic", antialias=True)
    return y.reshape(*lead, *y.shape[-3:])


def _normalize(x: torch.Tensor, mean, std, inplace: bool = False) -> torch.Tensor:
    m = torch.as_tensor(mean, dtype=x.dtype).view(-1, 1, 1)
    s = torch.as_tensor(std, dtype=x.dtype).view(-1, 1, 1)
    return (x - m) / s


tvF = types.SimpleNamespace(
    InterpolationMode=_Interpolation,
    resize=_resize,
    normalize=_normalize,
    grayscale_to_rgb=lambda x: x,
)


def _read_all(path: str) -> tuple[np.ndarray, float]:
    with av.open(path) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
        rate = float(c.streams.video[0].average_rate)
    return np.stack(frames), rate


class _DecordReader:
    """`decord.VideoReader` over PyAV: what qwen-vl-utils' decord path calls."""

    def __init__(self, path: str) -> None:
        self.frames, self.rate = _read_all(path)

    def __len__(self) -> int:
        return len(self.frames)

    def get_avg_fps(self) -> float:
        return self.rate

    def get_batch(self, idx):
        return types.SimpleNamespace(asnumpy=lambda: self.frames[list(idx)])


def _import_qwen_vl_utils() -> types.ModuleType:
    """qwen-vl-utils' module, torchvision's names standing in only while it imports (the
    stand-ins' uses are replaced in `references`)."""
    import importlib

    names = ("torchvision", "torchvision.io", "torchvision.transforms")
    saved = {n: sys.modules.get(n) for n in names}
    try:
        for n in names:
            sys.modules[n] = types.ModuleType(n)
        sys.modules["torchvision"].io = sys.modules["torchvision.io"]
        sys.modules["torchvision"].transforms = sys.modules["torchvision.transforms"]
        sys.modules["torchvision.transforms"].InterpolationMode = _Interpolation
        return importlib.import_module("qwen_vl_utils.vision_process")
    finally:
        for n, old in saved.items():
            if old is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = old


@contextmanager
def references() -> Iterator[types.SimpleNamespace]:
    """transformers' processor classes and qwen-vl-utils with torchvision's kernels restated."""
    import pytest
    from transformers import image_processing_backends, video_processing_utils
    from transformers.image_utils import PILImageResampling as R

    image_mod = import_without_torchvision("transformers.models.qwen2_vl.image_processing_qwen2_vl")
    video2 = import_without_torchvision("transformers.models.qwen2_vl.video_processing_qwen2_vl")
    video3 = import_without_torchvision("transformers.models.qwen3_vl.video_processing_qwen3_vl")
    qvu = _import_qwen_vl_utils()
    mapping = {R.BICUBIC: _Interpolation.BICUBIC, R.BILINEAR: _Interpolation.BILINEAR}
    with pytest.MonkeyPatch.context() as mp:
        for module in (
            image_processing_backends,
            video_processing_utils,
            image_mod,
            video2,
            video3,
        ):
            mp.setattr(module, "tvF", tvF, raising=False)
        mp.setattr(image_processing_backends, "pil_torch_interpolation_mapping", mapping)
        mp.setattr(
            qvu,
            "transforms",
            types.SimpleNamespace(functional=types.SimpleNamespace(resize=_resize)),
        )
        mp.setattr(qvu, "InterpolationMode", _Interpolation)
        mp.setattr(qvu, "get_video_reader_backend", lambda: "decord")
        read = qvu._read_video_decord

        def read_with_stand_in(ele):
            # `decord` is present only while qwen-vl-utils reads (transformers probes for it).
            with pytest.MonkeyPatch.context() as inner:
                inner.setitem(
                    sys.modules, "decord", types.SimpleNamespace(VideoReader=_DecordReader)
                )
                return read(ele)

        mp.setitem(qvu.VIDEO_READER_BACKENDS, "decord", read_with_stand_in)
        yield types.SimpleNamespace(
            image_processor=image_mod.Qwen2VLImageProcessor,
            video_processors={
                "qwen2": video2.Qwen2VLVideoProcessor,
                "qwen3": video3.Qwen3VLVideoProcessor,
            },
            qvu=qvu,
        )


def build_tokenizer(folder: Path) -> dict[str, int]:
    """A byte-level BPE with Qwen's special tokens, saved as a checkpoint keeps it; their ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "You are a helpful assistant. Describe the image and the video.",
        "What happens in these pictures? Compare them, then answer in 0.5 seconds.",
        "system user assistant Picture Video: 1 2 3 4 5 6 7 8 9 0 seconds < >",
    ] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    ).save_pretrained(folder)
    return {s: tok.token_to_id(s) for s in SPECIALS}


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2))
