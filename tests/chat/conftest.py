"""Tiny Qwen-VL checkpoints with a Qwen chat template and tokenizer, and their references."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mmferry.testing.checkpoints import hf_config
from tests.chat.oracle import build_tokenizer, references, write_json

# The Qwen2-VL chat template as the checkpoints ship it.
QWEN2_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3-VL's shape: whitespace control, `continue`, attribute access, a system message that
# may itself be a list of parts.
QWEN3_TEMPLATE = """
{%- if messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].content is string %}{{- messages[0].content }}
{%- else %}{%- for content in messages[0].content %}{%- if 'text' in content %}
{{- content.text }}{%- endif %}{%- endfor %}{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}{%- continue %}{%- endif %}
{{- '<|im_start|>' + message.role + '\\n' }}
{%- if message.content is string %}{{- message.content }}
{%- else %}{%- for content in message.content %}
{%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
{%- set image_count.value = image_count.value + 1 %}
{%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
<|vision_start|><|image_pad|><|vision_end|>
{%- elif content.type == 'video' or 'video' in content %}
{%- set video_count.value = video_count.value + 1 %}
{%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
<|vision_start|><|video_pad|><|vision_end|>
{%- elif 'text' in content %}{{- content.text }}
{%- endif %}{%- endfor %}{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

PROCESSORS = {
    "qwen2_vl": "Qwen2VLProcessor",
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "qwen3_vl": "Qwen3VLProcessor",
    "qwen3_5": "Qwen3VLProcessor",
}


def _configs(model_type: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(image processor, video processor settings, template): small limits, small grids."""
    if model_type.startswith("qwen2"):
        f, mean = 28, [0.48145466, 0.4578275, 0.40821073]
        std = [0.26862954, 0.26130258, 0.27577711]
        video = {"min_pixels": f * f * 4, "max_pixels": f * f * 24, "fps": 2.0}
        video |= {"do_sample_frames": True, "video_processor_type": "Qwen2VLVideoProcessor"}
        template = QWEN2_TEMPLATE
    else:
        f, mean, std = 32, [0.5] * 3, [0.5] * 3
        video = {"size": {"shortest_edge": f * f * 4, "longest_edge": f * f * 96}}
        video |= {"fps": 2.0, "do_sample_frames": True, "cap_pixels_per_frame": False}
        video["video_processor_type"] = "Qwen3VLVideoProcessor"
        template = QWEN3_TEMPLATE
    image = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "patch_size": f // 2,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "size": {"shortest_edge": f * f * 4, "longest_edge": f * f * 48},
        "image_mean": mean,
        "image_std": std,
    }
    video |= {k: image[k] for k in ("patch_size", "temporal_patch_size", "merge_size")}
    video |= {"image_mean": mean, "image_std": std}
    return image, video, template


@dataclass
class Checkpoint:
    model_type: str
    path: Path
    hf: Any  # transformers' processor for the folder (references' kernels)
    refs: Any  # the `references()` namespace (qwen-vl-utils among them)

    @property
    def patch_size(self) -> int:
        return self.hf.image_processor.patch_size


@pytest.fixture(scope="session")
def refs():
    with references() as r:
        yield r


def save_checkpoint(model_type: str, path: Path, refs: Any) -> Checkpoint:
    """A tiny checkpoint folder as transformers saves it, and transformers' processor for it."""
    import transformers
    from transformers import PreTrainedTokenizerFast
    from transformers.video_utils import load_video

    ids = build_tokenizer(path)
    tokens = {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }
    hf_config(model_type, **tokens).save_pretrained(path)
    image, video, template = _configs(model_type)
    write_json(path / "preprocessor_config.json", image)
    write_json(path / "video_preprocessor_config.json", video)
    (path / "chat_template.jinja").write_text(template)

    kind = "qwen2" if model_type.startswith("qwen2") else "qwen3"

    class PilReader:
        def fetch_images(self, urls):
            # transformers' PIL reader (torchvision's decoder stands behind its default).
            from transformers.image_utils import load_image

            if isinstance(urls, (list, tuple)):
                return [self.fetch_images(u) for u in urls]
            return load_image(urls) if isinstance(urls, str) else urls

    class ImageProcessor(PilReader, refs.image_processor):
        pass

    class VideoProcessor(PilReader, refs.video_processors[kind]):
        def fetch_videos(self, urls, sample_indices_fn=None):
            # transformers' own PyAV reader (its default, torchcodec, is not installed).
            if isinstance(urls, list):
                return list(zip(*[self.fetch_videos(u, sample_indices_fn) for u in urls]))
            return load_video(urls, backend="pyav", sample_indices_fn=sample_indices_fn)

    base = getattr(transformers, PROCESSORS[model_type])

    class HFProcessor(base):
        def check_argument_for_proper_class(self, name, arg):
            # transformers' video-processor registry is empty without torchvision.
            if name == "video_processor":
                return type(arg)
            return super().check_argument_for_proper_class(name, arg)

    strip = ("image_processor_type", "video_processor_type")
    hf = HFProcessor(
        image_processor=ImageProcessor(**{k: v for k, v in image.items() if k not in strip}),
        tokenizer=PreTrainedTokenizerFast.from_pretrained(path),
        video_processor=VideoProcessor(**{k: v for k, v in video.items() if k not in strip}),
        chat_template=template,
    )
    return Checkpoint(model_type, path, hf, refs)


@pytest.fixture(scope="session", params=list(PROCESSORS))
def checkpoint(request, refs, tmp_path_factory) -> Checkpoint:
    return save_checkpoint(request.param, tmp_path_factory.mktemp(request.param), refs)


@pytest.fixture(scope="session")
def media(tmp_path_factory) -> dict[str, Any]:
    """Images (PIL, files) and videos (files, frame lists) the message sets use."""
    import numpy as np
    from PIL import Image

    from tests.preprocess.reference import encode_video, moving_frames

    root = tmp_path_factory.mktemp("media")
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {}
    for name, (h, w) in {
        "small": (40, 60),
        "wide": (70, 150),
        "tall": (130, 60),
        "odd": (60, 90),
    }.items():
        smooth = moving_frames(1, h, w, seed=len(name))[0]
        noise = rng.integers(-20, 20, (h, w, 3))
        out[name] = Image.fromarray(np.clip(smooth + noise, 0, 255).astype(np.uint8))
        out[f"{name}_path"] = str(root / f"{name}.png")
        out[name].save(out[f"{name}_path"])
    for name, (n, h, w, fps) in {"clip": (16, 64, 96, 8), "long": (40, 48, 64, 10)}.items():
        path = root / f"{name}.mp4"
        encode_video(path, moving_frames(n, h, w, seed=n), fps)
        out[name] = str(path)
    out["frames"] = [Image.fromarray(f) for f in moving_frames(5, 56, 84, seed=3)]
    return out
