"""Baseline worker: transformers' default (torchvision) Qwen-VL image processor, timed in its
own environment (torch 2.14.1 + torchvision 0.29.1), driven over stdin/stdout by
`bench/preprocess.py` so its rounds interleave with mmferry's.

Protocol, one JSON object per line: {"cmd": "load", "files": [...], "settings": {...}} ->
{"ok": true}; {"cmd": "run", "kind": "pil" | "jpeg"} -> {"s": seconds};
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
            t0 = time.perf_counter()
            run(msg["kind"], list(range(len(datas))))
            reply = {"s": time.perf_counter() - t0}
        elif msg["cmd"] == "check":
            (out,) = run(msg["kind"], [msg["index"]])
            np.save(msg["out"], out.numpy())
            reply = {"ok": True}
        else:
            reply = {"error": f"unknown command {msg['cmd']!r}"}
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
