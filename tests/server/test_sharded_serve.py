"""`torchrun -m mmferry serve` on 2 CPU ranks (gloo): answers equal a single-process encode."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

import mmferry as mf
from mmferry.models import spec_for
from mmferry.preprocess.samples import sample_video
from mmferry.server.client import EncoderClient, image_part, video_part

from .conftest import DEPTH, IMAGE_MAX_PIXELS, ROOT, png


@pytest.mark.slow
def test_two_ranks_behind_one_endpoint():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["-m", "mmferry", "serve", "--port", "0", "--depth", str(DEPTH)]
    cmd += ["--image-max-pixels", str(IMAGE_MAX_PIXELS), "--shm-mib", "0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MMFERRY_API_KEY", None)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            found.append(line)
            if "listening on " in line:
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(300), "".join(found)
        url = next(ln for ln in found if "listening on " in ln).split("listening on ")[1].strip()
        assert any("on 2 rank(s)" in ln for ln in found)
        datas = [png(64, 64, 1), png(96, 48, 2), png(40, 72, 3)]
        parts = [image_part(d, "image/png") for d in datas] + [video_part(sample_video())]
        with EncoderClient(url) as c:
            got = c.encode(parts)
        proc_ = mf.Processor.for_model("qwen3-vl", image_max_pixels=IMAGE_MAX_PIXELS)
        enc = mf.VisionEncoder.random(config=spec_for("qwen3-vl").random_config.with_depth(DEPTH))
        items = [proc_.image(d, "compact-u8") for d in datas]
        items.append(proc_.video(str(sample_video()), "compact-u8"))
        with torch.inference_mode():
            outs = enc(items)
        for g, it, o in zip(got, items, outs):
            assert g.hash == it.hash and g.grid_thw == it.grid_thw
            torch.testing.assert_close(g.embeds, o.embeds, atol=1e-5, rtol=1e-5)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
