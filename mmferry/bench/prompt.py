"""mRoPE positions: mmferry's span-vectorised table vs transformers 5.24's `get_rope_index`.

Both produce the same `[3, L]` positions and delta for a fixed prompt (checked before timing).
transformers walks the ids (token-type grouping in Python, per-item tensor builds with `.item()`);
mmferry starts from the spans prompt expansion already knows and does a few tensor ops per grid
shape. Workloads (fixed): a Qwen3-VL prompt with a 1-hour video at 768 frames (384 temporal
patches of 4x7 merged tokens) plus 4 images, and a Qwen2.5-VL prompt with 8 images of
1044 tokens and a 3-patch video. Warm-up excluded; interleaved rounds, median and spread.

Needs transformers (the dev extra). Run: python -m mmferry.bench.prompt [--quick] [--json FILE]
"""

from __future__ import annotations

from functools import partial

import torch

from mmferry.bench import harness
from mmferry.items import MultimodalItem
from mmferry.models import preset, spec_for
from mmferry.prompt.expand import expand_prompt
from mmferry.prompt.mrope import VisionSpan, mrope_positions
from mmferry.testing.checkpoints import tiny_base_model

IMG, VID, VS, VE = 151655, 151656, 151652, 151653


def _item(modality: str, grid: tuple[int, int, int], **kw) -> MultimodalItem:
    t, h, w = grid
    feature = torch.zeros(t * h * w, 1).expand(-1, 8)  # metadata only: no real rows needed
    return MultimodalItem(modality, feature, grid, "hf", f"{modality}{grid}", **kw)


class _Digits:
    """Timestamp text as one id per character (the benchmark times positions, not tokenising)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def _workloads() -> list[tuple[str, str, list[int], list[MultimodalItem]]]:
    frames = 384
    video = _item("video", (frames, 8, 14), timestamps=tuple(0.5 + 2 * k for k in range(frames)))
    images = [_item("image", g) for g in [(1, 58, 72), (1, 16, 16), (1, 50, 62), (1, 8, 8)]]
    qwen3_ids = [1, 2, 3, VS, VID, VE, 4, 5] + sum(([6, VS, IMG, VE] for _ in images), []) + [7]
    qwen25_images = [_item("image", (1, 58, 72)) for _ in range(8)]
    qwen25_video = _item("video", (3, 28, 40), second_per_grid_t=1.0)
    qwen25_ids = sum(([6, VS, IMG, VE] for _ in qwen25_images), []) + [VS, VID, VE, 7, 8]
    return [
        ("qwen3_vl", "qwen3-vl: 1h video (384x28 tokens) + 4 images", qwen3_ids, [video, *images]),
        (
            "qwen2_5_vl",
            "qwen2.5-vl: 8 images x 1044 + video",
            qwen25_ids,
            [*qwen25_images, qwen25_video],
        ),
    ]


def _spans(out, items, family: str) -> list[VisionSpan]:
    spans = []
    for item, offsets in zip(items, out.offsets):
        t, h, w = item.grid_thw
        # Qwen2.5-VL's video time axis advances tokens_per_second (2) x 1 s per temporal patch.
        timed = spec_for(family).video_time_in_mrope and item.modality == "video"
        step = 2.0 if timed else 1.0
        for start, _ in offsets:
            frames = 1 if len(offsets) > 1 else t
            spans.append(VisionSpan(start, frames, h // 2, w // 2, step))
    return spans


def run(report: harness.Report, quick: bool) -> None:
    """Positions and the whole expansion against transformers' get_rope_index, per workload."""
    rounds = 5 if quick else 15
    for family, label, ids, items in _workloads():
        cfg = preset(family)
        tok = _Digits()
        out = expand_prompt(ids, items, cfg, tokenizer=tok, mrope_advance="spatial")
        model = tiny_base_model(family)
        ids_t = torch.tensor([out.input_ids])
        types = torch.zeros_like(ids_t, dtype=torch.int32)
        types[ids_t == IMG] = 1
        types[ids_t == VID] = 2
        kwargs = dict(
            image_grid_thw=torch.tensor([it.grid_thw for it in items if it.modality == "image"]),
            video_grid_thw=torch.tensor([it.grid_thw for it in items if it.modality == "video"]),
            attention_mask=torch.ones_like(ids_t),
        )
        if spec_for(family).video_time_in_mrope:
            kwargs["second_per_grid_ts"] = torch.tensor([1.0])
        baseline = partial(model.get_rope_index, ids_t, types, **kwargs)
        spans = _spans(out, items, family)
        positions_only = partial(mrope_positions, len(out.input_ids), spans, advance="spatial")
        whole = partial(expand_prompt, ids, items, cfg, tokenizer=tok, mrope_advance="spatial")

        pos, delta = baseline()
        harness.check_equal(f"{label} positions", out.positions, pos[:, 0])
        harness.check_equal(f"{label} positions only", positions_only()[0], out.positions)
        if int(delta) != out.mrope_delta:
            raise AssertionError(f"{label}: delta {out.mrope_delta} != {int(delta)}")
        head = f"{label}, L={len(out.input_ids)}"
        for what, fn in (
            ("positions (mrope_positions)", positions_only),
            ("whole expand_prompt (ids+offsets+positions)", whole),
        ):
            report.add(
                harness.compare(
                    f"{head}, {what}",
                    {"get_rope_index": baseline, "mmferry": fn},
                    rounds=rounds,
                    warmup=2,
                )
            )


def main(argv: list[str] | None = None) -> int:
    return harness.main_for(run, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())
