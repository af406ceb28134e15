"""A timestamped video's outer vision pair: which transformers releases keep it, and both forms
against the expanded prompt text tokenised whole (what a processor does), with a byte-level BPE
whose merges cross the point where the pair was (" <" is one token)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from prompt_helpers import make_item

import mmferry
from mmferry.config import TokenIds
from mmferry.models import preset
from mmferry.prompt.expand import expand_prompt
from mmferry.prompt.tokenizer import load_tokenizer
from mmferry.prompt.wrapper import keeps_outer_pair, kept_by
from tests.chat.oracle import build_tokenizer

TRIPLET = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
STAMPS = (0.3, 1.3, 2.4)
GRID = (3, 4, 4)  # 4 pads a frame at merge 2


@pytest.mark.parametrize(
    ("version", "kept"),
    [
        (None, False),  # no transformers: the form the models were released with
        ("4.57.6", False),
        ("5.0.0", False),
        ("5.9.0", False),
        ("5.10.1", True),
        ("5.19.0", True),
        ("5.24.0", True),
        ("5.25.0", False),
        ("5.26.0.dev0", False),
        ("6.1.0", False),
        ("main", False),
    ],
)
def test_releases_that_keep_the_pair(version, kept):
    assert kept_by(version) is kept


def test_auto_follows_the_installed_release():
    assert keeps_outer_pair("auto") is kept_by(transformers.__version__)
    assert keeps_outer_pair("keep") and not keeps_outer_pair("drop")
    with pytest.raises(ValueError, match="video_wrapper must be one of auto, keep, drop"):
        keeps_outer_pair("collapse")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bpe")
    ids = build_tokenizer(folder)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    tokens = TokenIds(
        image=ids["<|image_pad|>"],
        video=ids["<|video_pad|>"],
        vision_start=ids["<|vision_start|>"],
        vision_end=ids["<|vision_end|>"],
    )
    return folder / "tokenizer.json", hf, tokens


def _frames(per_frame: int) -> str:
    return "".join(
        f"<{t:.1f} seconds><|vision_start|>" + "<|video_pad|>" * per_frame + "<|vision_end|>"
        for t in STAMPS
    )


def _expanded_text(prompt: str, keep: bool) -> str:
    """The prompt as a processor writes it before tokenising it whole: the documented rule."""
    frames = _frames(GRID[1] * GRID[2] // 4)
    text = prompt.replace("<|image_pad|>", "<|image_pad|>" * 6)
    if TRIPLET not in text:  # a bare pad (no pair around it) expands in place in both forms
        return text.replace("<|video_pad|>", frames)
    return text.replace(TRIPLET, f"<|vision_start|>{frames}<|vision_end|>" if keep else frames)


PROMPTS = [
    "Video 1: " + TRIPLET + " What happens?",  # add_vision_id: text straight before the pair
    "<|im_start|>user\n" + TRIPLET + "Describe the video.<|im_end|>",
    "Describe" + TRIPLET,
    TRIPLET + " then " + IMAGE + " and " + TRIPLET,
    "Compare " + IMAGE + TRIPLET + " them",
    "a bare pad <|video_pad|> stays where it is",
]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("wrapper", ["keep", "drop"])
def test_forms_equal_the_text_tokenised_whole(bpe, prompt, wrapper):
    path, hf, tokens = bpe
    cfg = dataclasses.replace(preset("qwen3-vl"), tokens=tokens)
    ids = hf(prompt, add_special_tokens=False)["input_ids"]
    items = []
    for k in ids:
        if k == tokens.image:
            items.append(make_item("image", (1, 4, 6)))
        elif k == tokens.video:
            items.append(make_item("video", GRID, timestamps=STAMPS))
    out = expand_prompt(ids, items, cfg, tokenizer=path, video_wrapper=wrapper)
    want = hf(_expanded_text(prompt, wrapper == "keep"), add_special_tokens=False)["input_ids"]
    assert out.input_ids == want
    for item, spans in zip(items, out.offsets):
        pad = tokens.video if item.modality == "video" else tokens.image
        assert sum(e - s for s, e in spans) == item.num_tokens
        assert all(set(out.input_ids[s:e]) == {pad} for s, e in spans)
    assert out.positions.shape == (3, len(want))


def test_the_first_timestamp_merges_with_the_text_before_it(bpe):
    """The case a per-piece tokenisation gets wrong: ": <" is ":" + " <", not ": " + "<"."""
    path, hf, tokens = bpe
    cfg = dataclasses.replace(preset("qwen3-vl"), tokens=tokens)
    prompt = PROMPTS[0]
    ids = hf(prompt, add_special_tokens=False)["input_ids"]
    video = make_item("video", GRID, timestamps=STAMPS)
    out = expand_prompt(ids, [video], cfg, tokenizer=path, video_wrapper="drop")
    apart = hf("Video 1: ")["input_ids"] + hf(f"<{STAMPS[0]:.1f} seconds>")["input_ids"]
    whole = hf(f"Video 1: <{STAMPS[0]:.1f} seconds>")["input_ids"]
    assert apart != whole  # the tokenizer does merge across the point
    assert out.input_ids[: len(whole)] == whole

    # A tokenizer that can only encode cannot re-tokenise: the ids then stay apart, as said.
    class EncodeOnly:
        def encode(self, text: str) -> list[int]:
            return hf(text, add_special_tokens=False)["input_ids"]

    plain = load_tokenizer(EncodeOnly())
    rough = expand_prompt(ids, [video], cfg, tokenizer=plain, video_wrapper="drop")
    assert rough.input_ids[: len(apart)] == apart


def test_qwen2_5_videos_ignore_the_setting(bpe):
    _, hf, tokens = bpe
    cfg = dataclasses.replace(preset("qwen2.5-vl"), tokens=tokens)
    ids = hf(PROMPTS[0], add_special_tokens=False)["input_ids"]
    video = make_item("video", (2, 4, 4), second_per_grid_t=1.0)
    keep = expand_prompt(ids, [video], cfg, video_wrapper="keep")
    drop = expand_prompt(ids, [video], cfg, video_wrapper="drop")
    assert keep.input_ids == drop.input_ids and torch.equal(keep.positions, drop.positions)


def test_processor_passes_the_setting_on(bpe):
    path, hf, tokens = bpe
    proc = mmferry.Processor(dataclasses.replace(preset("qwen3-vl"), tokens=tokens), path)
    ids = hf(PROMPTS[1], add_special_tokens=False)["input_ids"]
    video = make_item("video", GRID, timestamps=STAMPS)
    kept = proc.expand_prompt(ids, [video], video_wrapper="keep")
    dropped = proc.expand_prompt(ids, [video], video_wrapper="drop")
    assert len(kept.input_ids) == len(dropped.input_ids) + 2
    auto = proc.expand_prompt(ids, [video])
    assert auto.input_ids == (kept if kept_by(transformers.__version__) else dropped).input_ids


@pytest.mark.parametrize("name", ["qwen3-vl", "qwen3-vl-moe", "qwen3.5", "qwen3.5-moe"])
@pytest.mark.parametrize("wrapper", ["keep", "drop"])
def test_every_qwen3_family(bpe, name, wrapper):
    path, hf, tokens = bpe
    cfg = dataclasses.replace(preset(name), tokens=tokens)
    prompt = PROMPTS[3]  # a video, an image, a video
    ids = hf(prompt, add_special_tokens=False)["input_ids"]
    video = make_item("video", GRID, timestamps=STAMPS)
    items = [video, make_item("image", (1, 4, 6)), video]
    out = expand_prompt(ids, items, cfg, tokenizer=path, video_wrapper=wrapper)
    want = hf(_expanded_text(prompt, wrapper == "keep"), add_special_tokens=False)["input_ids"]
    assert out.input_ids == want
