"""Greedy generation with transformers' Qwen-VL language model, fed only by mmferry.

    python examples/generate.py --model /path/to/Qwen3-VL-2B-Instruct
    python examples/generate.py --model /path/to/Qwen2.5-VL-3B-Instruct --chunk-size 256

mmferry does everything up to the language model: preprocessing, prompt expansion, the vision
encoder (loaded from the same checkpoint), and one `prefill_step` per chunk giving the input
embeddings, mRoPE positions, the vision-token mask and the deepstack rows. The language model
only runs its decoder layers; decode positions come from `decode_positions`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch

import mmferry as mf
from mmferry.embed.cache import EncoderCache
from mmferry.embed.step import StepRequest, prefill_step
from mmferry.prompt.mrope import decode_positions


def _forward(model: Any, step_embeds, positions, kv, mask=None, deepstack=()) -> torch.Tensor:
    lm = model.model.language_model
    extra: dict[str, Any] = {}
    if deepstack:  # Qwen3-VL towers tap deepstack levels; Qwen2/2.5-VL have none
        extra = dict(visual_pos_masks=mask[None], deepstack_visual_embeds=list(deepstack))
    out = lm(
        inputs_embeds=step_embeds[None],
        position_ids=positions[:, None],  # [3, n] -> [3, batch 1, n]
        cache=kv,
        use_cache=True,
        **extra,
    )
    return model.lm_head(out.last_hidden_state[0, -1:])[0]  # next-token logits


def greedy_generate(
    model: Any,
    proc: mf.Processor,
    enc: mf.VisionEncoder,
    text_ids: Sequence[int],
    items: Sequence[mf.MultimodalItem],
    *,
    max_new_tokens: int = 16,
    chunk_size: int | None = None,
    mrope_advance: str = "extent",
    eos_token_id: int | None = None,
) -> list[int]:
    """New token ids for the chat-template `text_ids` with one pad per item."""
    from transformers import DynamicCache

    prompt = proc.expand_prompt(text_ids, items, mrope_advance=mrope_advance)
    embed = model.model.language_model.embed_tokens
    kv = DynamicCache(config=model.config.text_config)
    cache = EncoderCache(1 << 30)  # an item cut by a chunk boundary is encoded once
    L = len(prompt.input_ids)
    chunk = chunk_size or L
    with torch.inference_mode():
        for start in range(0, L, chunk):
            req = StepRequest(prompt, items, start, min(start + chunk, L))
            step = prefill_step([req], embed_tokens=embed, encoder=enc, cache=cache)
            logits = _forward(
                model, step.inputs_embeds, step.positions, kv, step.vision_mask, step.deepstack
            )
        tokens: list[int] = []
        for k in range(max_new_tokens):
            tok = int(logits.argmax())
            tokens.append(tok)
            if tok == eos_token_id or k == max_new_tokens - 1:
                break
            emb = embed(torch.tensor([tok], device=logits.device))
            # Generated token k sits at index L + k; its position adds the prompt's delta.
            pos = decode_positions([L + k], [prompt.mrope_delta], device=logits.device)
            logits = _forward(model, emb, pos, kv)
    return tokens


def main() -> None:
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from mmferry.preprocess.samples import sample_images

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        "--model-dir",
        dest="model_dir",
        required=True,
        help="a local Qwen-VL checkpoint folder",
    )
    ap.add_argument("--images", nargs="*", help="image files (default: the bundled samples)")
    ap.add_argument("--question", default="Describe the images.")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--chunk-size", type=int, default=None, help="prefill chunk (default: one)")
    args = ap.parse_args()

    model = AutoModelForImageTextToText.from_pretrained(args.model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    proc = mf.Processor.from_pretrained(args.model_dir)
    enc = mf.VisionEncoder.from_pretrained(args.model_dir)
    items = [proc.image(p, layout="compact-u8") for p in (args.images or sample_images())]
    pads = "<|vision_start|><|image_pad|><|vision_end|>" * len(items)
    text = f"<|im_start|>user\n{pads}{args.question}<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    new = greedy_generate(
        model.eval(),
        proc,
        enc,
        ids,
        items,
        max_new_tokens=args.max_new_tokens,
        chunk_size=args.chunk_size,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    print(tokenizer.decode(new))


if __name__ == "__main__":
    main()
