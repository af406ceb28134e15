"""The generic family against transformers: Gemma 3 and GLM-4.1V tiny checkpoints, and
Qwen2.5-VL through the generic path against mmferry's native one.

The oracle is transformers itself: the whole model loaded by `from_pretrained` (its own weight
loading), its processor run on the prompt with all images at once, `get_image_features` on the
batch. mmferry's rows come per image from `Processor.from_pretrained` and
`VisionEncoder.from_pretrained`, which load only the vision tensors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import mmferry as mf
from mmferry.encoder.generic import GenericVisionEncoder
from mmferry.models.generic import GenericProcessor
from mmferry.testing.families import save_family_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines"))

import tiny_vlm  # noqa: E402

FAMILIES = ("gemma3", "glm4v")
# Sizes are multiples of 28 (no resampling in grid processors); Gemma 3 resizes all to 56x56.
SIZES = ((56, 84), (84, 56), (56, 84))
# Measured max |mmferry - transformers| was 0.0 for both families (same kernels, one image
# per call against the batch); the bound leaves room for a BLAS that blocks batches apart.
ATOL = 1e-5


def _images() -> list[np.ndarray]:
    return [tiny_vlm.image(h, w, seed) for seed, (h, w) in enumerate(SIZES)]


def hf_processor(folder: Path):
    """transformers' processor for the folder, built from its classes (a processor that has a
    video processor cannot be loaded whole without torchvision; images need none of it)."""
    config = transformers.AutoConfig.from_pretrained(folder)
    if config.model_type == "gemma3":
        return transformers.AutoProcessor.from_pretrained(folder)

    class Glm4vProcessor(transformers.Glm4vProcessor):
        def check_argument_for_proper_class(self, name, arg):
            return (
                None
                if name == "video_processor"
                else super().check_argument_for_proper_class(name, arg)
            )

    return Glm4vProcessor(
        image_processor=transformers.Glm4vImageProcessorPil.from_pretrained(folder),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        video_processor=None,
    )


def hf_rows(model, batch) -> torch.Tensor:
    keys = ("pixel_values", "image_grid_thw")
    with torch.no_grad():
        out = model.model.get_image_features(**{k: batch[k] for k in keys if k in batch})
    rows = out.pooler_output
    if isinstance(rows, tuple):
        rows = torch.cat(rows)
    return rows.reshape(-1, rows.shape[-1])


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    folder = save_family_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder).eval()
    return request.param, folder, model, hf_processor(folder)


def _prompt(hf) -> str:
    parts = [
        {"type": "text", "text": "describe"},
        {"type": "image"},
        {"type": "text", "text": "and"},
    ]
    parts += [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "what"}]
    return hf.tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)


def test_rows_equal_transformers(family):
    name, folder, model, hf = family
    proc = mf.Processor.from_pretrained(folder)
    enc = mf.VisionEncoder.from_pretrained(folder)
    assert isinstance(proc, GenericProcessor) and isinstance(enc, GenericVisionEncoder)
    images = _images()
    items = proc.images(images)
    ours = torch.cat([o.embeds for o in enc(items)])
    batch = hf(text=[_prompt(hf)], images=[images], return_tensors="pt")
    want = hf_rows(model, batch)
    assert ours.shape == want.shape and ours.shape[1] == proc.facts.row_width
    diff = (ours - want).abs().max().item()
    assert diff <= ATOL, f"{name}: max abs difference {diff}"
    # A different image gives other rows (the check can fail).
    other = enc(proc.images([tiny_vlm.gradient(56, 84, 9)]))[0].embeds
    assert (other - ours[: other.shape[0]]).abs().max() > 0.1


def test_prompt_expands_as_transformers(family):
    _, folder, _, hf = family
    proc = mf.Processor.from_pretrained(folder)
    images = _images()
    items = proc.images(images)
    text = _prompt(hf)
    ids = hf.tokenizer(text, add_special_tokens=False)["input_ids"]
    got = proc.expand_prompt(ids, items)
    want = hf(text=[text], images=[images], return_tensors="pt")["input_ids"][0].tolist()
    assert got.input_ids == want
    row = proc.facts.row_token_id
    spans = [s for spans in got.offsets for s in spans]
    assert sum(e - s for s, e in spans) == want.count(row)
    assert all(want[i] == row for s, e in spans for i in range(s, e))
    assert [it.num_tokens for it in items] == [sum(e - s for s, e in o) for o in got.offsets]
    with pytest.raises(ValueError, match="placeholders for 2 items"):
        proc.expand_prompt(ids, items[:2])


def test_only_vision_weights_are_loaded(family):
    _, folder, _, _ = family
    enc = mf.VisionEncoder.from_pretrained(folder)
    model = enc.model
    text = list(model.get_decoder().parameters()) + list(model.lm_head.parameters())
    assert text and all(p.is_meta for p in text)
    vision = [p for n, p in model.named_parameters() if all(p is not t for t in text)]
    assert vision and not any(p.is_meta for p in vision)


def test_grid_is_read_from_the_processor(family):
    name, folder, _, _ = family
    item = mf.Processor.from_pretrained(folder).image(_images()[0])
    # GLM-4.1V's processor gives a grid (mRoPE positions need it); Gemma 3's gives none.
    assert item.grid_thw == ((1, 4, 6) if name == "glm4v" else None)


def test_gemma3_video_is_a_clear_error(tmp_path):
    folder = save_family_checkpoint("gemma3", tmp_path)
    proc = mf.Processor.from_pretrained(folder)
    with pytest.raises(ValueError, match=r"Gemma3Processor\) takes no video"):
        proc.video(np.zeros((4, 56, 56, 3), np.uint8))
    with pytest.raises(ValueError, match="compact-u8 is a native-family format"):
        proc.image(_images()[0], "compact-u8")
    # A bad item is named by its index, or left in its place with partial=True.
    good = _images()[0]
    with pytest.raises(mf.ItemError, match="item 1: "):
        proc.images([good, b"not an image"])
    got = proc.images([good, b"not an image", good], partial=True)
    assert isinstance(got[1], mf.ItemError) and got[1].index == 1
    assert got[0].hash == got[2].hash and got[0].num_tokens == 4


def test_generic_matches_native_on_qwen2_5_vl(tmp_path):
    folder = tiny_vlm.build_checkpoint("qwen2_5_vl", tmp_path)
    native_proc, native_enc = (
        mf.Processor.from_pretrained(folder),
        mf.VisionEncoder.from_pretrained(folder),
    )
    proc = mf.Processor.from_pretrained(folder, family="generic")
    enc = mf.VisionEncoder.from_pretrained(folder, family="generic")
    assert isinstance(proc, GenericProcessor) and isinstance(enc, GenericVisionEncoder)
    assert not isinstance(native_proc, GenericProcessor)
    # "auto" (the commands' --family default) keeps the native spec.
    assert not isinstance(mf.Processor.from_pretrained(folder, family="auto"), GenericProcessor)
    images = [tiny_vlm.image(56, 84, 0), tiny_vlm.image(112, 56, 1)]
    native = native_enc(native_proc.images(images))
    items = proc.images(images)
    generic = enc(items)
    assert [it.grid_thw for it in items] == [it.grid_thw for it in native_proc.images(images)]
    for a, b in zip(native, generic, strict=True):
        assert a.embeds.shape == b.embeds.shape
        assert (a.embeds - b.embeds).abs().max().item() <= 1e-4
    # The prompts expand alike: the same pads in the same places.
    tok = native_proc.tokenizer
    ids = tok.encode(
        "describe <|vision_start|><|image_pad|><|vision_end|> and "
        "<|vision_start|><|image_pad|><|vision_end|>"
    )
    assert (
        proc.expand_prompt(ids, items).input_ids
        == native_proc.expand_prompt(ids, native_proc.images(images)).input_ids
    )


def test_a_checkpoint_neither_family_serves_is_a_clear_error(tmp_path):
    """A model_type transformers does not know, and a text-only checkpoint of a known one."""
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "no-such-vlm"}))
    for load in (mf.Processor.from_pretrained, mf.VisionEncoder.from_pretrained):
        with pytest.raises(ValueError, match="neither the native nor the generic family"):
            load(unknown)
    text = save_family_checkpoint("gemma3", tmp_path / "text")
    config = json.loads((text / "config.json").read_text())
    (text / "config.json").write_text(
        json.dumps({**config["text_config"], "model_type": "gemma3_text"})
    )
    for load in (mf.Processor.from_pretrained, mf.VisionEncoder.from_pretrained):
        with pytest.raises(ValueError, match="gemma3_text.*the generic family cannot serve it"):
            load(text)
