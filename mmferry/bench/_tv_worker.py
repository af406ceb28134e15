"""Baseline worker: transformers' default (torchvision) Qwen-VL image processor, timed in its
own environment (torch 2.14.1 + torchvision 0.29.1), driven over stdin/stdout by
`bench/preprocess.py` so its rounds interleave with mmferry's.

Protocol, one JSON object per line: {"cmd": "load", "files": [...], "settings": {...}} ->
{"ok": true}; {"cmd": "run", "kind": "pil" | "jpeg"} (optionally "items": [i, ...], the
images of the round, and "repeat": n, times each) -> {"s": seconds, "cpu": CPU seconds of
the process (all its threads)}; {"cmd": "stages"} -> {stage: CPU seconds} over the PIL images;
{"cmd": "check", "index": i, "kind": ..., "out": path.npy} -> {"ok": true}; {"cmd": "quit"}.
Imports only the baseline's own packages (no mmferry).
"""

from __future__ import annotations

import io
import json
import sys
import time
import warnings
from pathlib import Path


def main() -> int:
    """Serve commands until "quit" or end of input."""
    warnings.filterwarnings("ignore")
    import numpy as np
    from PIL import Image, ImageOps
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    proc = None
    datas: list[bytes] = []
    images: list[Image.Image] = []

    def load(data: bytes) -> Image.Image:
        # transformers' load_image: EXIF orientation, then RGB.
        return ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")

    def run(kind: str, items: list[int]) -> list:
        outs = []
        for i in items:
            im = images[i] if kind == "pil" else load(datas[i])
            outs.append(proc(images=[im], return_tensors="pt")["pixel_values"])
        return outs

    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "quit":
            break
        if msg["cmd"] == "load":
            datas = [Path(f).read_bytes() for f in msg["files"]]
            images = [load(d) for d in datas]
            proc = Qwen2VLImageProcessor(**msg["settings"])
            reply = {"ok": True}
        elif msg["cmd"] == "run":
            t0, c0 = time.perf_counter(), time.process_time()
            items = msg.get("items", list(range(len(datas))))
            run(msg["kind"], items * msg.get("repeat", 1))
            reply = {"s": time.perf_counter() - t0, "cpu": time.process_time() - c0}
        elif msg["cmd"] == "stages":
            reply = stages(proc, images)
        elif msg["cmd"] == "check":
            (out,) = run(msg["kind"], [msg["index"]])
            np.save(msg["out"], out.numpy())
            reply = {"ok": True}
        else:
            reply = {"error": f"unknown command {msg['cmd']!r}"}
        print(json.dumps(reply), flush=True)
    return 0


def stages(proc, images: list) -> dict[str, float]:
    """CPU seconds of each step the processor takes, over the PIL images: the calls its
    `_preprocess` makes (torchvision's pil_to_tensor, its resize, rescale and normalise, the
    patch reshape), each timed alone, and the processor's whole call beside them."""
    from torchvision.transforms.v2 import functional as tvf

    p = proc
    out = dict.fromkeys(("to tensor", "resize", "normalise", "patchify", "whole call"), 0.0)

    def clock(name: str, fn):
        c0 = time.process_time()
        value = fn()
        out[name] += time.process_time() - c0
        return value

    factor = p.patch_size * p.merge_size
    for im in images:
        x = clock("to tensor", lambda im=im: tvf.pil_to_tensor(im)[None])
        x = clock(
            "resize", lambda x=x: p.resize(x, size=p.size, resample=p.resample, factor=factor)
        )
        x = clock(
            "normalise",
            lambda x=x: p.rescale_and_normalize(
                x, True, p.rescale_factor, True, p.image_mean, p.image_std
            ),
        )
        clock(
            "patchify",
            lambda x=x: p.patchify(
                x,
                patch_size=p.patch_size,
                merge_size=p.merge_size,
                temporal_patch_size=p.temporal_patch_size,
            )[0].contiguous(),
        )
        clock("whole call", lambda im=im: p(images=[im], return_tensors="pt"))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
