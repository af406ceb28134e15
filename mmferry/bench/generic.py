"""Native Qwen2.5-VL spec vs the generic family on the same checkpoint: what the fast path is worth.

One Qwen2.5-VL checkpoint saved by transformers into a temporary folder (Qwen2.5-VL's tower
width: 1280 wide, 16 heads, MLP 3420, window attention; 2 blocks, the last with full attention,
so it runs in seconds on a CPU; random weights; a tiny language model) is read both ways:
`Processor.from_pretrained(dir)` / `VisionEncoder.from_pretrained(dir)` (native) and the same
with `family="generic"` (the folder's transformers processor, transformers' tower). The
workload: four 224x224 JPEG images and one 448x448, as encoded bytes. Preprocessing (decode,
resize, patchify, hash; one thread on both sides) and encoding are timed apart, interleaved
over rounds, after the rows are checked: the generic rows within 1e-4 of the native ones
(measured 4.5e-6 on the tests' checkpoint).

Run: python -m mmferry.bench.generic [--quick] [--json FILE]   (--quick: 1 block, 3 images)
"""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from mmferry.bench import harness

QWEN_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN_IDS = (151652, 151653, 151655, 151656)


def _tokenizer(folder: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "describe": 1}
    vocab.update(dict(zip(QWEN_SPECIALS, QWEN_IDS, strict=True)))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in QWEN_SPECIALS])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)


def save_checkpoint(folder: Path, depth: int) -> Path:
    """A Qwen2.5-VL checkpoint with the public tower's width and `depth` blocks."""
    import transformers

    vision = dict(
        depth=depth,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=512,
        window_size=112,
        fullatt_block_indexes=[depth - 1],
    )
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [8, 12, 12]}
    text = dict(
        hidden_size=512,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=152000,
        rope_parameters=rope,
    )
    cfg = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text)
    torch.manual_seed(0)
    transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval().save_pretrained(folder)
    _tokenizer(folder)
    image = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "patch_size": 14,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }
    (folder / "preprocessor_config.json").write_text(json.dumps(image))
    return folder


def _jpegs(sizes: list[tuple[int, int]]) -> list[bytes]:
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for h, w in sizes:
        # A smooth field plus noise: a photo-like JPEG, not pure noise.
        base = np.linspace(0, 255, w)[None, :, None] * rng.uniform(0.3, 1.0, (1, 1, 3))
        pixels = np.clip(base + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def run(report: harness.Report, quick: bool) -> None:
    import mmferry as mf

    depth = 1 if quick else 2
    sizes = [(224, 224)] * (2 if quick else 4) + [(448, 448)]
    sources = _jpegs(sizes)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_checkpoint(Path(tmp), depth)
        native_proc = mf.Processor.from_pretrained(folder)
        native_enc = mf.VisionEncoder.from_pretrained(folder)
        generic_proc = mf.Processor.from_pretrained(folder, family="generic")
        generic_enc = mf.VisionEncoder.from_pretrained(folder, family="generic")

    def native_pre():
        return native_proc.images(sources, layout="compact-u8", threads=1)

    def generic_pre():
        return generic_proc.images(sources)

    native_items, generic_items = native_pre(), generic_pre()
    for i, (a, b) in enumerate(zip(native_enc(native_items), generic_enc(generic_items))):
        harness.check_equal(f"image {i} rows", a.embeds, b.embeds, atol=1e-4)
    patches = sum(it.num_patches for it in native_items)
    what = f"{len(sources)} JPEGs ({patches} patches), Qwen2.5-VL tower 1280 wide, {depth} blocks"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # both sides on one core: the machine may be shared
    try:
        report.add(
            harness.compare(
                f"preprocess {len(sources)} images, 1 thread",
                {"generic (transformers processor)": generic_pre, "mmferry native": native_pre},
                note=what,
            )
        )
        report.add(
            harness.compare(
                f"encode {len(sources)} images, 1 thread",
                {
                    "generic (transformers tower)": lambda: generic_enc(generic_items),
                    "mmferry native": lambda: native_enc(native_items),
                },
                note=what + "; rows checked within 1e-4 first",
            )
        )
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> int:
    return harness.main_for(run, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())
