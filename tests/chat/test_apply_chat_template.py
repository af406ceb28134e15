"""`Processor.apply_chat_template` equals transformers' token for token, over many message sets.

Message sets without qwen-vl-utils keys are checked against transformers'
`processor.apply_chat_template(..., tokenize=True, return_dict=True)`; those with them (and
frame lists, qwen-vl-utils' form) against what Qwen's model cards run: qwen-vl-utils'
`process_vision_info`, then transformers' processor on its output with `do_resize=False` (a
per-item budget replaces the checkpoint's). See oracle.py for what runs.
"""

from __future__ import annotations

import base64
import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import mmferry as mf

VIDEO_KEYS = {"video_url"}


@dataclass
class Case:
    name: str
    messages: list[dict[str, Any]]
    kwargs: dict[str, Any] = field(default_factory=dict)
    qwen_utils: bool = False  # the reference is process_vision_info + the processor


def _data_url(path: str) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()


def user(*parts: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(parts)}


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def cases(m: dict[str, Any]) -> list[Case]:
    img, vid = m["small"], m["clip"]
    system = {"role": "system", "content": "You are a helpful assistant."}
    return [
        Case("text only", [user(text("Describe the video."))], {"add_generation_prompt": True}),
        Case("string content", [{"role": "user", "content": "What happens?"}]),
        Case(
            "system and one image",
            [system, user({"type": "image", "image": img}, text("Describe the image."))],
            {"add_generation_prompt": True},
        ),
        Case(
            "images with text between",
            [
                user(
                    text("Compare"),
                    {"type": "image", "image": m["wide_path"]},
                    text(" and "),
                    {"type": "image", "url": m["tall_path"]},
                    text("?"),
                )
            ],
            {"add_generation_prompt": True},
        ),
        Case(
            "OpenAI data URL",
            [user({"type": "image_url", "image_url": {"url": _data_url(m["wide_path"])}})],
        ),
        Case(
            "OpenAI file URL",
            [
                user(
                    text("the image"),
                    {"type": "image_url", "image_url": "file://" + m["tall_path"]},
                )
            ],
            {"add_generation_prompt": True},
        ),
        Case(
            "Responses API parts",
            [
                user(
                    {"type": "input_text", "text": "Describe"},
                    {"type": "input_image", "image_url": m["small_path"]},
                )
            ],
        ),
        Case(
            "multi-turn",
            [
                system,
                user({"type": "image", "path": m["small_path"]}, text("What is it?")),
                {"role": "assistant", "content": "A picture."},
                user(text("And this?"), {"type": "image", "image": m["wide"]}),
            ],
            {"add_generation_prompt": True},
        ),
        Case(
            "image in an assistant turn",
            [
                user(text("Draw it")),
                {"role": "assistant", "content": [{"type": "image", "image": img}, text("Done.")]},
            ],
        ),
        Case("one video", [user({"type": "video", "video": vid}, text("What happens?"))]),
        Case(
            "OpenAI video_url",
            [user({"type": "video_url", "video_url": {"url": vid}}, text("Describe the video."))],
            {"add_generation_prompt": True},
        ),
        Case(
            "videos and images mixed",
            [
                system,
                user(
                    {"type": "image", "image": m["tall"]},
                    text("then"),
                    {"type": "video", "video": m["long"]},
                    text("and"),
                    {"type": "image", "image": img},
                    {"type": "video", "video": vid},
                ),
            ],
            {"add_generation_prompt": True},
        ),
        Case(
            "system as parts",
            [
                {"role": "system", "content": [text("Be brief.")]},
                user({"type": "image", "image": img}),
            ],
        ),
        Case(
            "add_vision_id",
            [
                user(
                    {"type": "image", "image": img},
                    {"type": "image", "image": m["wide"]},
                    {"type": "video", "video": vid},
                )
            ],
            {"add_generation_prompt": True, "add_vision_id": True},
        ),
        Case(
            "call fps",
            [user({"type": "video", "video": m["long"]}, text("Describe the video."))],
            {"processor_kwargs": {"fps": 4}},
        ),
        Case(
            "call keeps every frame",
            [user({"type": "video", "video": m["clip"]})],
            {"processor_kwargs": {"do_sample_frames": False}, "add_generation_prompt": True},
        ),
        Case(
            "image min/max pixels",
            [
                user(
                    {"type": "image", "image": m["wide"], "min_pixels": 50000, "max_pixels": 90000},
                    text("?"),
                )
            ],
            qwen_utils=True,
        ),
        Case(
            "image max pixels, path",
            [user({"type": "image", "image": m["tall_path"], "max_pixels": 5000}, text("?"))],
            qwen_utils=True,
        ),
        Case(
            "image resized_height/width",
            [user({"type": "image", "image": img, "resized_height": 100, "resized_width": 50})],
            {"add_generation_prompt": True},
            qwen_utils=True,
        ),
        Case(
            "video fps",
            [user({"type": "video", "video": m["long"], "fps": 4.0}, text("What happens?"))],
            qwen_utils=True,
        ),
        Case(
            "video nframes",
            [user(text("Describe"), {"type": "video", "video": m["long"], "nframes": 7})],
            {"add_generation_prompt": True},
            qwen_utils=True,
        ),
        Case(
            "video frames and pixels",
            [
                user(
                    {
                        "type": "video",
                        "video": m["long"],
                        "min_frames": 6,
                        "max_frames": 10,
                        "fps": 1.0,
                        "min_pixels": 4096,
                        "max_pixels": 20000,
                        "total_pixels": 40000,
                    }
                )
            ],
            qwen_utils=True,
        ),
        Case(
            "video start and end",
            [user({"type": "video", "video": m["long"], "video_start": 1.0, "video_end": 3.2})],
            qwen_utils=True,
        ),
        Case(
            "frame list",
            [user({"type": "video", "video": m["frames"]}, text("What happens?"))],
            {"add_generation_prompt": True},
            qwen_utils=True,
        ),
        Case(
            "frame list with sample_fps and sizes",
            [
                user(
                    text("First"),
                    {
                        "type": "video",
                        "video": m["frames"][:4],
                        "sample_fps": 1.0,
                        "min_pixels": 4096,
                        "max_pixels": 20000,
                    },
                    text("then"),
                    {"type": "image", "image": m["wide"], "max_pixels": 20000},
                    {"type": "video", "video": m["clip"], "nframes": 4},
                )
            ],
            qwen_utils=True,
        ),
        Case(
            "image min_pixels above the checkpoint's maximum",
            [user({"type": "image", "image": m["odd"], "min_pixels": 50000, "max_pixels": 200000})],
            qwen_utils=True,
        ),
        Case(
            "video pixel budget and nframes",
            [
                user(
                    {
                        "type": "video",
                        "video": m["long"],
                        "min_pixels": 50000,
                        "max_pixels": 200000,
                        "nframes": 6,
                    },
                    text("What happens?"),
                )
            ],
            qwen_utils=True,
        ),
        Case(
            "resized_height/width above the checkpoint's maximum",
            [
                user(
                    {"type": "image", "image": img, "resized_height": 300, "resized_width": 250},
                    {
                        "type": "video",
                        "video": m["clip"],
                        "resized_height": 200,
                        "resized_width": 300,
                    },
                )
            ],
            qwen_utils=True,
        ),
        Case(
            "video total_pixels",
            [user({"type": "video", "video": m["long"], "total_pixels": 300000, "fps": 1.0})],
            qwen_utils=True,
        ),
        Case(
            "frame list with raw_fps and resized_height/width",
            [
                user(
                    {
                        "type": "video",
                        "video": m["frames"],
                        "sample_fps": 2.0,
                        "raw_fps": 8.0,
                        "resized_height": 160,
                        "resized_width": 240,
                    }
                )
            ],
            qwen_utils=True,
        ),
    ]


def hf_form(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same conversation in the part forms transformers reads (it reads no OpenAI video
    parts, no Responses parts and no file: URLs)."""
    out = []
    for msg in messages:
        content = msg["content"]
        if isinstance(content, list):
            parts = []
            for p in content:
                p = dict(p)
                kind = p["type"]
                if kind == "input_text":
                    p = text(p["text"])
                elif kind in ("input_image", "image_url", "video_url"):
                    ref = p["image_url" if kind == "input_image" else kind]
                    url = ref["url"] if isinstance(ref, dict) else ref
                    url = url.removeprefix("file://")
                    p = {"type": "video" if kind == "video_url" else "image", "url": url}
                parts.append(p)
            msg = {**msg, "content": parts}
        out.append(msg)
    return out


def qwen_utils_form(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as process_vision_info reads it: media under "image" / "video"."""
    out = copy.deepcopy(messages)
    for msg in out:
        for p in msg["content"] if isinstance(msg["content"], list) else []:
            for key in ("url", "path"):
                if key in p:
                    p[p["type"]] = p.pop(key)
    return out


def reference(ckpt, case: Case) -> dict[str, Any]:
    from transformers.video_utils import VideoMetadata

    msgs = hf_form(case.messages)
    kwargs = copy.deepcopy(case.kwargs)  # transformers writes into processor_kwargs
    if not case.qwen_utils:
        out = ckpt.hf.apply_chat_template(
            copy.deepcopy(msgs), tokenize=True, return_dict=True, return_tensors="pt", **kwargs
        )
        return dict(out)
    prompt = ckpt.hf.apply_chat_template(copy.deepcopy(msgs), tokenize=False, **kwargs)
    images, videos, _ = ckpt.refs.qvu.process_vision_info(
        qwen_utils_form(msgs),
        return_video_kwargs=True,
        return_video_metadata=True,
        image_patch_size=ckpt.patch_size,
    )
    fields = ("fps", "frames_indices", "total_num_frames")
    out = ckpt.hf(
        text=[prompt],
        images=images,
        videos=[v for v, _ in videos] if videos else None,
        video_metadata=[VideoMetadata(**{k: meta[k] for k in fields}) for _, meta in videos]
        if videos
        else None,
        do_sample_frames=False,
        # The model cards' recipe: qwen-vl-utils' sizes are final.
        do_resize=False,
        return_tensors="pt",
    )
    return dict(out)


def check(ckpt, case: Case) -> None:
    proc = mf.Processor.from_pretrained(ckpt.path)
    want = reference(ckpt, case)
    kwargs = dict(case.kwargs)
    got_text = proc.apply_chat_template(case.messages, **kwargs)
    assert got_text == ckpt.hf.apply_chat_template(hf_form(case.messages), **kwargs)
    ours = proc.apply_chat_template(case.messages, tokenize=True, return_dict=True, **kwargs)
    got = ours.to_transformers()
    assert got["input_ids"].tolist() == want["input_ids"].tolist(), case.name
    assert got["attention_mask"].tolist() == want["attention_mask"].tolist()
    for grid in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts"):
        if grid in want:
            assert torch.equal(got[grid], torch.as_tensor(want[grid]).to(got[grid].dtype)), grid
        else:
            # Qwen2-VL's processor gives no second_per_grid_ts; its items still carry them.
            assert grid not in got or grid == "second_per_grid_ts", grid
    for key in ("pixel_values", "pixel_values_videos"):
        if key in want:
            a, b = got[key], want[key]
            assert a.shape == b.shape, key
            if case.qwen_utils:
                # qwen-vl-utils resizes images with PIL's bicubic first, which differs from
                # torchvision's on these noisy test images by a few levels on average.
                assert (a - b).abs().mean() < 0.1, key
            else:
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("index", range(30))
def test_equals_transformers(checkpoint, media, index):
    all_cases = cases(media)
    assert len(all_cases) == 30
    check(checkpoint, all_cases[index])
