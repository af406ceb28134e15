"""Prompt expansion against the installed transformers' Qwen2VLProcessor / Qwen2_5_VLProcessor /
Qwen3VLProcessor (5.25, and 5.24 in `make test`'s second run), token for token, plus offsets,
errors and the Processor front door.

What is compared: the processors' own `__call__` (placeholder check, `replace_image_token` /
`replace_video_token`, `get_text_with_replacements`, tokenisation, `mm_token_type_ids`) with
images run through the PIL image processor. Their video processors need torchvision, which is
absent here, so `_process_videos` is replaced by one that hands the processor precomputed grids
and frame metadata (indices, fps); the text expansion, including Qwen3-VL's timestamp rule, is
still transformers' own code.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from prompt_helpers import TOK, hf_processor, hf_timestamps, make_item

import mmferry
from mmferry.models import preset
from mmferry.prompt.expand import expand_prompt
from mmferry.prompt.wrapper import kept_by

VS, VE, IMG, VID = TOK.vision_start, TOK.vision_end, TOK.image, TOK.video


PROMPT = (
    "describe <|vision_start|><|image_pad|><|vision_end|> and "
    "<|vision_start|><|video_pad|><|vision_end|> what happens ? "
    "<|vision_start|><|image_pad|><|vision_end|> the video "
    "<|vision_start|><|video_pad|><|vision_end|>"
)
# Worked case E8: 300 frames at 30 fps sampled at 2 fps -> timestamps 0.3, 1.3, 2.4; the second
# video has an odd frame count (padded to 6 by repeating the last).
VIDEO_FRAMES = [([0, 16, 31, 47, 63, 79], 30.0), ([0, 5, 9, 14, 20], 10.0)]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_matches_transformers_processor(family, hf_tokenizer, tokenizer_json, hf_rope):
    cfg = preset(family)
    f = cfg.factor
    video_grids = [(3, 4, 6), (3, 2, 4)]
    videos = [(g, ix, fps) for g, (ix, fps) in zip(video_grids, VIDEO_FRAMES)]
    proc = hf_processor(family, hf_tokenizer, videos)
    images = [Image.new("RGB", (3 * f, 2 * f), "red"), Image.new("RGB", (f, 4 * f), "blue")]
    pixel_videos = [np.zeros((len(ix), 8, 8, 3), np.uint8) for ix, _ in VIDEO_FRAMES]
    want = proc(text=[PROMPT], images=images, videos=pixel_videos, return_tensors="pt")

    image_grids = [tuple(g) for g in want["image_grid_thw"].tolist()]
    assert image_grids == [(1, 4, 6), (1, 8, 2)]  # the PIL image processor's own resize
    spgt = [cfg.temporal_patch_size / 2.0, 1.0]
    it = iter(image_grids)
    vt = iter(zip(videos, spgt))
    items = []
    for kind in ("image", "video", "image", "video"):
        if kind == "image":
            items.append(make_item("image", next(it)))
        else:
            (grid, ix, fps), s = next(vt)
            items.append(
                make_item("video", grid, timestamps=hf_timestamps(ix, fps), second_per_grid_t=s)
            )
    # Items may come in any interleaving: matching is per modality, in order of appearance.
    items = [items[1], items[0], items[3], items[2]]

    ids = hf_tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    out = expand_prompt(ids, items, cfg, tokenizer=tokenizer_json, mrope_advance="spatial")
    assert out.input_ids == want["input_ids"][0].tolist()

    # Vision tokens are exactly where transformers marks them, and mRoPE agrees too.
    types = want["mm_token_type_ids"][0]
    pads = sorted(i for spans in out.offsets for s, e in spans for i in range(s, e))
    assert pads == torch.nonzero(types != 0).flatten().tolist()
    vgrids = [g for g, _, _ in videos]
    pos, delta = hf_rope(family)(out.input_ids, image_grids, vgrids, spgt)
    assert torch.equal(out.positions, pos)
    assert out.mrope_delta == delta

    if family == "qwen3_vl":
        # The installed release's form: the template's pair around the frames kept or dropped.
        text = hf_tokenizer.decode(out.input_ids)
        first = "< 0 . 3 seconds > <|vision_start|>"  # E8's first frame
        assert first in text
        assert ("<|vision_start|> " + first in text) == kept_by(transformers.__version__)


@pytest.mark.parametrize("wrapper", ["keep", "drop"])
def test_offsets_point_at_pad_tokens(tokenizer_json, wrapper):
    cfg = preset("qwen3-vl")
    image = make_item("image", (1, 4, 6))
    video = make_item("video", (3, 4, 4), timestamps=(0.3, 1.3, 2.4))
    ids = [100, VS, VID, VE, 101, VS, IMG, VE, 102]
    out = expand_prompt(ids, [image, video], cfg, tokenizer=tokenizer_json, video_wrapper=wrapper)
    got = out.input_ids
    assert out.offsets[0] == [(s, s + 6) for s in [got.index(IMG)]]
    assert len(out.offsets[1]) == 3
    for k, (s, e) in enumerate(out.offsets[1]):
        assert e - s == 4
        assert set(got[s:e]) == {VID}
        assert got[s - 1] == VS and got[e] == VE
        # "<t seconds>" precedes each frame's vision_start: "<", digit(s), ".", digit, ...
        ts = f"{video.timestamps[k]:.1f}"
        digits = [10 + int(c) for c in ts.replace(".", "")]
        assert got[s - 1 - 2 - len(ts) - 1 : s - 1] == [1, *digits[:-1], 3, digits[-1], 4, 2]
    assert got.count(VID) == 12 and got.count(IMG) == 6
    kept = wrapper == "keep"
    # The chat template's own pair stays around the frames, or goes (2 ids fewer).
    assert got[1 : 3 if kept else 2] == ([VS, 1] if kept else [1])
    assert got[got.index(101) - 2 : got.index(101)] == ([VE, VE] if kept else [VID, VE])
    # 6 timestamp tokens per frame
    assert len(got) == len(ids) - 2 + 6 + 3 * (6 + 1 + 4 + 1) - (0 if kept else 2)


def test_input_forms_agree():
    cfg = preset("qwen2.5-vl")
    items = [make_item("image", (1, 2, 4)), make_item("video", (2, 2, 2), second_per_grid_t=1.0)]
    ids = [100, VS, IMG, VE, VS, VID, VE, 101]
    ref = expand_prompt(ids, items, cfg)
    for form in (np.array(ids), np.array(ids, dtype=np.int32), torch.tensor(ids)):
        out = expand_prompt(form, items, cfg)
        assert out.input_ids == ref.input_ids and out.offsets == ref.offsets
        assert torch.equal(out.positions, ref.positions) and out.mrope_delta == ref.mrope_delta
    assert all(type(i) is int for i in ref.input_ids)
    assert ref.offsets == [[(2, 4)], [(6, 8)]]


def test_placeholder_count_mismatch_raises():
    cfg = preset("qwen2-vl")
    image = make_item("image", (1, 2, 2))
    with pytest.raises(ValueError, match=r"2 <\|image_pad\|> placeholder\(s\) but 1 image"):
        expand_prompt([IMG, 5, IMG], [image], cfg)
    with pytest.raises(ValueError, match=r"0 <\|video_pad\|> placeholder\(s\) but 1 video"):
        expand_prompt([IMG], [image, make_item("video", (2, 2, 2))], cfg)
    with pytest.raises(ValueError, match="already expanded"):
        expand_prompt([IMG] * 4, [make_item("image", (1, 4, 4))], cfg)
    with pytest.raises(ValueError, match="1-D"):
        expand_prompt([[IMG]], [image], cfg)


def test_qwen3_video_needs_tokenizer_and_timestamps(tokenizer_json):
    cfg = preset("qwen3-vl")
    video = make_item("video", (2, 2, 2), timestamps=(0.5, 1.5))
    with pytest.raises(ValueError, match="need the checkpoint's tokenizer.*tokenizer="):
        expand_prompt([VS, VID, VE], [video], cfg)
    with pytest.raises(ValueError, match="from_pretrained"):
        mmferry.Processor.for_model("qwen3-vl").expand_prompt([VS, VID, VE], [video])
    with pytest.raises(ValueError, match="timestamp"):
        expand_prompt([VID], [make_item("video", (2, 2, 2))], cfg, tokenizer=tokenizer_json)
    # Images alone never need the tokenizer.
    out = expand_prompt([VS, IMG, VE], [make_item("image", (1, 2, 2))], cfg)
    assert out.input_ids == [VS, IMG, VE]


def test_processor_end_to_end(tokenizer_json, hf_tokenizer):
    proc = mmferry.Processor.for_model("qwen3-vl", tokenizer=tokenizer_json)
    items = [
        make_item("image", (1, 4, 4)),
        make_item("video", (2, 4, 2), timestamps=hf_timestamps([0, 3, 6, 9], 6.0)),
    ]
    ids = hf_tokenizer(
        "hello <|vision_start|><|image_pad|><|vision_end|> "
        "<|vision_start|><|video_pad|><|vision_end|> what happens ?",
        add_special_tokens=False,
    )["input_ids"]
    out = proc.expand_prompt(ids, items)
    assert isinstance(out, mmferry.ExpandedPrompt)
    text = hf_tokenizer.decode(out.input_ids)
    assert (
        text.count("seconds") == 2 and "< 0 . 2 seconds >" in text and "< 1 . 2 seconds >" in text
    )
    assert [e - s for s, e in out.offsets[0]] == [4]
    assert [e - s for s, e in out.offsets[1]] == [2, 2]
    assert out.positions.shape == (3, len(out.input_ids))
    # The front door loads tokenizer.json once and encodes without special tokens.
    assert proc.tokenizer.encode("<1.5 seconds>") == [1, 11, 3, 15, 4, 2]
