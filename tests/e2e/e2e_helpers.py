"""Tiny Qwen-VL checkpoints (transformers saves them), prompts, and an mmferry-fed LM forward."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from prompt_helpers import build_tokenizer_json, hf_processor

import mmferry as mf
from mmferry.embed.cache import EncoderCache
from mmferry.embed.step import StepRequest, prefill_step
from mmferry.models import preset
from mmferry.prompt.mrope import decode_positions

PRESET = {"qwen3_vl": "qwen3-vl", "qwen2_5_vl": "qwen2.5-vl"}
TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    vocab_size=152000,
    rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]},
)
NUM_FRAMES, VIDEO_FPS = 4, 2.0


@dataclass
class Tiny:
    family: str
    path: Path
    model: Any  # transformers' ...ForConditionalGeneration, float32, eval
    hf_tokenizer: Any
    image_processor: Any
    proc: mf.Processor  # mmferry, from the same folder
    enc: mf.VisionEncoder  # mmferry, from the same folder


def _hf_model(family: str):
    import transformers

    if family == "qwen3_vl":
        vision = dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=32,
            patch_size=16,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0, 1],
        )
        cfg = transformers.Qwen3VLConfig(vision_config=vision, text_config=TEXT)
        return transformers.Qwen3VLForConditionalGeneration(cfg)
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=32,
        patch_size=14,
        window_size=56,
        fullatt_block_indexes=[1],
        tokens_per_second=2,
    )
    text = {k: v for k, v in TEXT.items() if k != "head_dim"}
    cfg = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text)
    return transformers.Qwen2_5_VLForConditionalGeneration(cfg)


def build_tiny(family: str, path: Path) -> Tiny:
    """Save a perturbed tiny checkpoint, tokenizer.json and preprocessor config; load both sides."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    torch.manual_seed(0)
    model = _hf_model(family)
    # Perturb every weight so norms, biases and the vision path are far from their init.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    model.eval().save_pretrained(path)
    build_tokenizer_json(path)
    cfg = preset(PRESET[family])
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=cfg.patch_size,
        merge_size=cfg.merge_size,
        temporal_patch_size=cfg.temporal_patch_size,
        min_pixels=cfg.factor**2,
        max_pixels=cfg.factor**2 * 64,
        image_mean=list(cfg.image_mean),
        image_std=list(cfg.image_std),
    )
    image_processor.save_pretrained(path)
    f = cfg.factor
    proc = mf.Processor.from_pretrained(
        path, video_min_pixels=f * f * 4, video_max_pixels=f * f * 12
    )
    enc = mf.VisionEncoder.from_pretrained(path)
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    return Tiny(family, path, model, hf_tok, image_processor, proc, enc)


def images(sizes: list[tuple[int, int]], seed: int = 0) -> list[Image.Image]:
    """Random RGB images of these (height, width)."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def video_frames(h: int, w: int, seed: int = 7) -> np.ndarray:
    """A THWC uint8 clip of NUM_FRAMES frames."""
    return np.random.default_rng(seed).integers(0, 256, (NUM_FRAMES, h, w, 3), dtype=np.uint8)


@dataclass
class Case:
    """One prompt, as transformers' processor makes it and as mmferry makes it."""

    hf_inputs: dict[str, Any]  # input_ids, attention_mask, pixel_values, ... for the HF model
    text_ids: list[int]  # the chat-template ids before expansion
    media: list[tuple[str, Any]]  # ("image", PIL) | ("video", frames) in prompt order


def make_case(tiny: Tiny, media: list[tuple[str, Any]], text: str = "describe the image") -> Case:
    """The prompt 'hello <media...> text' through transformers' processor (ids, pixels, grids)."""
    parts = ["hello"]
    for kind, _ in media:
        pad = "<|image_pad|>" if kind == "image" else "<|video_pad|>"
        parts.append(f"<|vision_start|>{pad}<|vision_end|>")
    prompt = " ".join([*parts, text])
    # Videos: transformers' video processor needs torchvision, so the grid and pixels come from
    # mmferry's hf layout (checked against transformers' video processing in tests/preprocess).
    vids = [
        tiny.proc.video(v, layout="hf", num_frames=NUM_FRAMES, source_fps=VIDEO_FPS)
        for k, v in media
        if k == "video"
    ]
    meta = [(it.grid_thw, list(range(NUM_FRAMES)), VIDEO_FPS) for it in vids]
    p = hf_processor(tiny.family, tiny.hf_tokenizer, meta)
    p.image_processor = tiny.image_processor
    imgs = [m for k, m in media if k == "image"]
    out = p(
        text=[prompt],
        images=imgs or None,
        videos=[v for k, v in media if k == "video"] or None,
        return_tensors="pt",
    )
    inputs = {k: v for k, v in out.items() if k != "video_metadata"}
    if imgs:
        # Same grids as transformers' PIL processor; the pixels are mmferry's hf layout, since
        # PIL's and torch's bicubic differ by a fraction of a level by design (both are checked
        # in tests/preprocess), and the comparison here is of the model path.
        ours = [tiny.proc.image(m, layout="hf") for m in imgs]
        assert [list(it.grid_thw) for it in ours] == inputs["image_grid_thw"].tolist()
        inputs["pixel_values"] = torch.cat([it.feature for it in ours])
    if vids:
        inputs["pixel_values_videos"] = torch.cat([it.feature for it in vids])
        if tiny.family == "qwen2_5_vl":
            inputs["second_per_grid_ts"] = torch.tensor([it.second_per_grid_t for it in vids])
    text_ids = tiny.hf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return Case(inputs, text_ids, media)


def mmferry_items(tiny: Tiny, case: Case, layouts: list[str]) -> list[mf.MultimodalItem]:
    """mmferry's items for the case's media, item k in `layouts[k]`."""
    out = []
    for (kind, m), layout in zip(case.media, layouts):
        if kind == "image":
            out.append(tiny.proc.image(m, layout=layout))
        else:
            out.append(
                tiny.proc.video(m, layout=layout, num_frames=NUM_FRAMES, source_fps=VIDEO_FPS)
            )
    return out


def advance(tiny: Tiny) -> str:
    """transformers 5.x resumes text after a Qwen2.5-VL video at start + max(h, w)."""
    return "spatial" if tiny.family == "qwen2_5_vl" else "extent"


@dataclass
class Run:
    logits: torch.Tensor  # [L, V] prompt logits, then one row per decode step
    tokens: list[int]  # greedy tokens generated


def _lm_forward(tiny: Tiny, embeds, positions, cache, mask=None, deepstack=None):
    lm = tiny.model.model.language_model
    kwargs: dict[str, Any] = {}
    if tiny.family == "qwen3_vl" and deepstack:
        kwargs = dict(visual_pos_masks=mask[None], deepstack_visual_embeds=list(deepstack))
    out = lm(
        inputs_embeds=embeds[None],
        position_ids=positions[:, None],  # [3, n] -> [3, batch 1, n]
        cache=cache,
        use_cache=True,
        **kwargs,
    )
    return tiny.model.lm_head(out.last_hidden_state)[0]


def run_mmferry(
    tiny: Tiny,
    prompt,
    items,
    bounds: list[int],
    *,
    new_tokens: int = 16,
    cache: EncoderCache | None = None,
    tamper=None,
) -> Run:
    """Prefill in chunks ending at `bounds`, then greedy decoding, fed only by mmferry.

    `tamper(step_output) -> (embeds, positions, mask, deepstack)` is for negative controls.
    """
    from transformers import DynamicCache

    lm = tiny.model.model.language_model
    kv = DynamicCache(config=tiny.model.config.text_config)
    cache = cache if cache is not None else EncoderCache(1 << 26)
    logits, start = [], 0
    with torch.no_grad():
        for end in bounds:
            step = prefill_step(
                [StepRequest(prompt, items, start, end)],
                embed_tokens=lm.embed_tokens,
                encoder=tiny.enc,
                cache=cache,
            )
            parts = (step.inputs_embeds, step.positions, step.vision_mask, step.deepstack)
            if tamper is not None:
                parts = tamper(step)
            logits.append(_lm_forward(tiny, *parts[:2], kv, *parts[2:]))
            start = end
        L = len(prompt.input_ids)
        tokens: list[int] = []
        for k in range(new_tokens):
            tok = int(logits[-1][-1].argmax())
            tokens.append(tok)
            if k == new_tokens - 1:
                break
            emb = lm.embed_tokens(torch.tensor([tok]))
            pos = decode_positions([L + k], [prompt.mrope_delta])  # [3, 1]
            logits.append(_lm_forward(tiny, emb, pos, kv))
    return Run(torch.cat(logits), tokens)


def run_transformers(tiny: Tiny, case: Case, new_tokens: int = 16) -> Run:
    """transformers' own generate (greedy) and its logits for the prompt and each new token."""
    with torch.no_grad():
        out = tiny.model.generate(
            **case.hf_inputs,
            max_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        prompt_logits = tiny.model(**case.hf_inputs).logits[0]
    L = case.hf_inputs["input_ids"].shape[1]
    tokens = out.sequences[0, L:].tolist()
    # out.logits[k] scores the k-th new token; the first equals the prompt's last row.
    steps = torch.cat([x for x in out.logits[1:]])
    return Run(torch.cat([prompt_logits, steps]), tokens)


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-4) -> bool:
    """Within `rel` of the reference's scale, elementwise."""
    return a.shape == b.shape and bool((a - b).abs().max() <= rel * b.abs().max())
