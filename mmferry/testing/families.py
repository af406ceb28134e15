"""Tiny transformers checkpoints of families mmferry serves through the generic family.

Each folder is what a published checkpoint holds, shrunk: config.json and safetensors saved by
transformers from the family's own config class (random weights, nudged off their init), a
word-level tokenizer with the family's special tokens, and the family's processor saved by
transformers, so `AutoProcessor`, `AutoModelForImageTextToText` and vLLM all read the folder
as they read the real one. Text sizes suit vLLM's CPU attention (head size 32).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# Images the tests use are multiples of 28 pixels inside this many patches of 14, so
# grid-based processors do not resample them.
MAX_PATCHES = 64
_TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    vocab_size=1000,
    max_position_embeddings=4096,
)
_WORDS = ["hello", "world", "describe", "the", "image", "and", "what", "is", "this", "?"]
VISION_GAIN, LOGIT_GAIN = 8.0, 20.0


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "mmferry.testing's tiny checkpoints need transformers: pip install 'mmferry[testing]'"
        ) from None
    return transformers


def _tokenizer(
    folder: Path,
    specials: list[str],
    named: dict[str, str],
    template: str,
    plain: tuple[str, ...] = (),
) -> None:
    """A word-level tokenizer: <bos>, <eos>, a few words, `specials` (ids from 100) and `plain`
    (added tokens that are text, ids from 200)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tf = _transformers()
    vocab = {"[UNK]": 0, "<bos>": 1, "<eos>": 2, "<pad>": 3}
    vocab.update({w: 10 + i for i, w in enumerate(_WORDS)})
    vocab.update({s: 100 + i for i, s in enumerate(specials)})
    vocab.update({s: 200 + i for i, s in enumerate(plain)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in plain])
    tf.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="[UNK]",
        extra_special_tokens=named,
        chat_template=template,
    ).save_pretrained(folder)


def _template(image: str) -> str:
    """A chat template writing `image` once per image part, as the real ones do."""
    return (
        "{% for m in messages %}<bos>{% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %} " + image + " "
        "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
        "{% endfor %}"
    )


def _nudge(model: Any, last: list[Any]) -> None:
    """Every weight off its init; louder rows and sharper logits (greedy tokens then depend on
    the image), as the Qwen engine checkpoints do."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        for layer in last:
            for p in layer.parameters():
                p.mul_(VISION_GAIN)
        model.lm_head.weight.mul_(LOGIT_GAIN)


def _gemma3(folder: Path) -> None:
    tf = _transformers()
    specials = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    named = dict(zip(("boi_token", "eoi_token", "image_token"), specials, strict=True))
    # Gemma 3 wraps each image in blank lines; vLLM looks its newline runs up by text.
    newlines = tuple("\n" * n for n in range(4, 0, -1))
    _tokenizer(folder, specials, named, _template("<start_of_image>"), newlines)
    # 56-pixel images of 14-pixel patches: 16 patches pooled to 4 tokens.
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=56,
        patch_size=14,
    )
    cfg = tf.Gemma3Config(
        vision_config=vision,
        text_config={**_TEXT, "sliding_window": 64, "query_pre_attn_scalar": 32},
        mm_tokens_per_image=4,
        boi_token_index=100,
        eoi_token_index=101,
        image_token_index=102,
    )
    torch.manual_seed(0)
    model = tf.Gemma3ForConditionalGeneration(cfg)
    _nudge(model, [])
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.mul_(VISION_GAIN)
    model.eval().save_pretrained(folder)
    _published_siglip_keys(folder / "model.safetensors")
    image = tf.Gemma3ImageProcessorPil(size={"height": 56, "width": 56})
    tok = tf.AutoTokenizer.from_pretrained(folder)
    tf.Gemma3Processor(image_processor=image, tokenizer=tok, image_seq_length=4).save_pretrained(
        folder
    )


def _published_siglip_keys(path: Path) -> None:
    """The SigLIP tower's keys as published Gemma 3 checkpoints hold them
    (`vision_tower.vision_model.*`, which vLLM reads); transformers 5 saves them without
    `vision_model` and reads both."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    renamed = {
        k.replace("vision_tower.", "vision_tower.vision_model.", 1)
        if k.startswith("vision_tower.")
        else k: v
        for k, v in tensors.items()
    }
    save_file(renamed, path, metadata={"format": "pt"})


def _glm4v(folder: Path) -> None:
    tf = _transformers()
    specials = [
        "<|image|>",
        "<|begin_of_image|>",
        "<|end_of_image|>",
        "<|video|>",
        "<|begin_of_video|>",
        "<|end_of_video|>",
    ]
    _tokenizer(folder, specials, {}, _template("<|begin_of_image|><|image|><|end_of_image|>"))
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=_TEXT["hidden_size"],
        patch_size=14,
        image_size=56,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}
    text = {**_TEXT, "rope_parameters": {**rope, "partial_rotary_factor": 0.5}}
    cfg = tf.Glm4vConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=100,
        image_start_token_id=101,
        image_end_token_id=102,
        video_token_id=103,
        video_start_token_id=104,
        video_end_token_id=105,
    )
    torch.manual_seed(0)
    model = tf.Glm4vForConditionalGeneration(cfg)
    _nudge(model, [model.model.visual.merger.down_proj])
    model.eval().save_pretrained(folder)
    image = tf.Glm4vImageProcessorPil(
        size={"shortest_edge": 28 * 28, "longest_edge": 14 * 14 * MAX_PATCHES},
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
    )
    image.save_pretrained(folder)
    # Written, not saved by Glm4vProcessor: building one needs its video processor, which
    # needs torchvision. The folder then reads as a published one without a video config.
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Glm4vProcessor"}))


BUILDERS: dict[str, Callable[[Path], None]] = {"gemma3": _gemma3, "glm4v": _glm4v}


def save_family_checkpoint(model_type: str, folder: Path) -> Path:
    """Save a tiny `model_type` ("gemma3" | "glm4v") checkpoint folder into `folder`."""
    try:
        build = BUILDERS[model_type]
    except KeyError:
        raise ValueError(
            f"no tiny builder for {model_type!r}; have: {', '.join(BUILDERS)}"
        ) from None
    folder.mkdir(parents=True, exist_ok=True)
    build(folder)
    return folder
